//! ScorePods with text in (`prompt`, `chat`) and llm-d's GetPodScores, end to end: a publisher
//! stores the blocks vLLM would hash for the same token ids, and the daemon, tokenizing the text
//! itself, finds them. With the tokenizer this project builds (always) and with the real Qwen3
//! tokenizer from `../shared/tokenizers` (skipped with a message when absent, required in CI).

mod support;

use std::time::Duration;

use kv_core::{RequestExtras, TokenProcessor, TokenProcessorConfig};
use kv_indexer::config::{Config, ModelConfig};
use kv_indexer::daemon::{self, RunningDaemon};
use kv_proto::indexer_v1::{indexer_service_client::IndexerServiceClient, GetPodScoresRequest};
use kv_proto::kvindexer_v1::{
    kv_indexer_client::KvIndexerClient, score_pods_request::Input, ChatMessage, ChatRequest,
    ScorePodsRequest,
};
use kv_tokenize::LoadedTokenizer;
use kv_tokenize::{ChatInput, ChatMessage as Msg};
use zeromq::{PubSocket, Socket, SocketSend};

struct Fleet {
    daemon: RunningDaemon,
    publisher: PubSocket,
    grpc: KvIndexerClient<tonic::transport::Channel>,
    processor: TokenProcessor,
    block_size: usize,
    seq: u64,
}

impl Fleet {
    async fn start(model: &str, tokenizer: &std::path::Path, block_size: usize) -> Self {
        let mut c = Config::default();
        c.server.grpc_addr = "127.0.0.1:0".into();
        c.server.metrics_addr = "127.0.0.1:0".into();
        c.kv_events_config.zmq_endpoint = "tcp://127.0.0.1:0".into();
        c.indexer_config.token_processor_config.hash_seed = Some("12345".into());
        c.indexer_config.token_processor_config.block_size = block_size;
        c.indexer_config.prefix_store_config.block_size = 64;
        c.indexer_config.tokenizers_pool_config.offline = true;
        c.models.insert(
            model.into(),
            ModelConfig {
                tokenizer: Some(tokenizer.display().to_string()),
                ..Default::default()
            },
        );
        let daemon = daemon::start(c).await.expect("daemon starts");
        let mut publisher = PubSocket::new();
        publisher
            .connect(daemon.zmq_endpoint.as_deref().expect("bind mode"))
            .await
            .expect("PUB connects");
        let grpc = KvIndexerClient::connect(format!("http://{}", daemon.grpc_addr))
            .await
            .expect("gRPC");
        let processor = TokenProcessor::new(&TokenProcessorConfig {
            hash_seed: Some("12345".into()),
            block_size,
            ..Default::default()
        })
        .expect("valid");
        Self {
            daemon,
            publisher,
            grpc,
            processor,
            block_size,
            seq: 0,
        }
    }

    /// Publishes `pod` storing the blocks of `ids` until the daemon has applied the message,
    /// then scores `request` once: its first ScorePods, so the text is tokenized in full (a
    /// later call of the same text reads the prefix store, whose hit covers only the prompt's
    /// stored text blocks, see `kv_tokenize::prefix`). Waiting for the message rather than for
    /// a non-zero score also keeps a score from reading the run while it is being applied
    /// (reads never wait for writes).
    async fn store_until_scored(
        &mut self,
        model: &str,
        pod: &str,
        ids: &[u32],
        request: Input,
    ) -> u32 {
        let hashes = self.processor.block_hashes(ids, &RequestExtras::default());
        assert!(!hashes.is_empty(), "the prompt must have full blocks");
        let tokens = &ids[..hashes.len() * self.block_size];
        let seq = self.seq;
        self.seq += 1;
        let mut applied = false;
        for _ in 0..100 {
            let msg = support::pods::token_stored_message(
                model,
                pod,
                seq,
                &hashes,
                tokens,
                self.block_size,
            );
            self.publisher.send(msg).await.expect("send");
            tokio::time::sleep(Duration::from_millis(50)).await;
            applied = support::pods::list(&self.daemon)
                .await
                .iter()
                .any(|p| p.pod == pod && p.last_sequence >= seq as i64);
            if applied {
                break;
            }
        }
        assert!(applied, "the stored blocks were never applied");
        let r = self
            .grpc
            .score_pods(ScorePodsRequest {
                model: model.into(),
                input: Some(request),
                pods: vec![pod.into()],
                ..Default::default()
            })
            .await
            .expect("ScorePods")
            .into_inner();
        assert_eq!(r.total_blocks as usize, hashes.len());
        r.scores[0].matched_blocks
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_and_chat_with_the_projects_own_tokenizer() {
    let dir = support::temp_dir("tiny-tokenizer");
    support::tiny_tokenizer(&dir);
    let model = "acme/tiny";
    let tok = LoadedTokenizer::from_files(model, &dir.join("tokenizer.json")).expect("loads");
    let mut fleet = Fleet::start(model, &dir, 4).await;

    let prompt = "you are helpful assistant . answer question about kubernetes pods and nodes !";
    let ids = tok.encode_prompt(prompt).expect("encodes").ids;
    assert_eq!(ids[0], 1, "completion prompts get the BOS");
    let matched = fleet
        .store_until_scored(model, "10.3.0.1:8000", &ids, Input::Prompt(prompt.into()))
        .await;
    assert_eq!(
        matched as usize,
        ids.len() / 4,
        "every full block of the prompt"
    );

    let chat = ChatRequest {
        messages: vec![
            ChatMessage {
                role: "system".into(),
                content: "you are helpful assistant".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "what should i do first ?".into(),
            },
        ],
        add_generation_prompt: true,
        ..Default::default()
    };
    let input = ChatInput {
        messages: chat
            .messages
            .iter()
            .map(|m| Msg {
                role: m.role.clone(),
                content: m.content.clone(),
            })
            .collect(),
        add_generation_prompt: true,
        ..Default::default()
    };
    let (_, encoded) = tok.encode_chat(&input).expect("renders");
    let matched = fleet
        .store_until_scored(
            model,
            "10.3.0.2:8000",
            &encoded.ids,
            Input::Chat(chat.clone()),
        )
        .await;
    assert_eq!(matched as usize, encoded.ids.len() / 4);

    // A template error is INVALID_ARGUMENT; bad kwargs JSON too.
    let bad = ChatRequest {
        chat_template_kwargs_json: "{not json".into(),
        ..chat
    };
    let e = fleet
        .grpc
        .score_pods(ScorePodsRequest {
            model: model.into(),
            input: Some(Input::Chat(bad)),
            ..Default::default()
        })
        .await
        .expect_err("bad JSON");
    assert_eq!(e.code(), tonic::Code::InvalidArgument);

    // llm-d's GetPodScores: prompt text in, scores out.
    let mut llmd = IndexerServiceClient::connect(format!("http://{}", fleet.daemon.grpc_addr))
        .await
        .expect("gRPC");
    let r = llmd
        .get_pod_scores(GetPodScoresRequest {
            prompt: prompt.into(),
            model_name: model.into(),
            pod_identifiers: vec!["10.3.0.1:8000".into(), "10.3.0.9:8000".into()],
        })
        .await
        .expect("GetPodScores")
        .into_inner();
    assert_eq!(r.scores.len(), 2);
    assert_eq!(r.scores[0].pod, "10.3.0.1:8000");
    assert!(r.scores[0].score > 0.0 && r.scores[1].score == 0.0, "{r:?}");

    let (_, page) = {
        let mut s = tokio::net::TcpStream::connect(fleet.daemon.metrics_addr)
            .await
            .expect("http");
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .expect("req");
        let mut b = String::new();
        s.read_to_string(&mut b).await.expect("resp");
        ((), b)
    };
    assert!(
        page.contains("kvcache_tokenization_tokenized_tokens_total"),
        "{page}"
    );
    assert!(
        page.contains("kvindexer_prefix_store_lookups_total{result=\"hit\"}"),
        "repeated prompts hit the store"
    );
    fleet.daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen3_chat_finds_the_blocks_vllm_stored() {
    let Some((dir, samples)) = support::shared_samples("qwen3") else {
        return;
    };
    let chat = &samples["chat"];
    let ids: Vec<u32> = support::u32s(&chat["ids"]);
    let model = "Qwen/Qwen3-8B";
    let mut fleet = Fleet::start(model, &dir, 16).await;
    let request = ChatRequest {
        messages: chat["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .map(|m| ChatMessage {
                role: m["role"].as_str().expect("role").into(),
                content: m["content"].as_str().expect("content").into(),
            })
            .collect(),
        add_generation_prompt: true,
        chat_template_kwargs_json: r#"{"enable_thinking": false}"#.into(),
        tools_json: String::new(),
    };
    let matched = fleet
        .store_until_scored(model, "10.4.0.1:8000", &ids, Input::Chat(request))
        .await;
    assert_eq!(
        matched as u64,
        chat["blocks_of_16_full"].as_u64().expect("blocks"),
        "every full block"
    );
    fleet.daemon.shutdown().await;
}
