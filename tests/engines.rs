//! Keys from tokens, end to end: engines whose hashes are not the index's keys (vLLM with
//! xxhash, sha256, other seeds and block sizes; SGLang) publish over real ZMQ sockets to a daemon
//! with the default settings (`hashSeed: "12345"`, blocks of 16), and ScorePods scores each one
//! exactly. The payloads are vLLM 0.33.0's and SGLang 0.5.23's own (kv-core's
//! `tests/fixtures/engines`, made with their code; see its README).

mod support;

use std::time::Duration;

use kv_indexer::daemon;
use zeromq::{SocketSend, ZmqMessage};

const MODEL: &str = "engines/model";

fn message(pod: &str, seq: u64, payload: &[u8]) -> ZmqMessage {
    support::pods::payload_message(MODEL, pod, seq, payload)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_engine_in_the_table_scores_exactly_over_real_sockets() {
    let mut config = support::loopback_config();
    config.indexer_config.token_processor_config.hash_seed = Some("12345".into());
    let d = daemon::start(config).await.expect("daemon starts");
    let mut publisher = support::pods::connect(&d).await;
    let mut grpc = support::client(&d).await;
    let scenarios = support::engine_scenarios();
    for (i, s) in scenarios.iter().enumerate() {
        let pod = format!("10.9.0.{i}:8000");
        // The first message until it is applied (the slow-joiner window), then the rest.
        let mut applied = false;
        for _ in 0..200 {
            publisher
                .send(message(&pod, 0, &s.messages[0]))
                .await
                .expect("send");
            tokio::time::sleep(Duration::from_millis(25)).await;
            if support::matched_blocks(&mut grpc, MODEL, &support::past(&s.tokens), &pod).await
                == s.matched_after[0]
            {
                applied = true;
                break;
            }
        }
        assert!(applied, "{}: the first message never scored", s.name);
        for (seq, payload) in s.messages.iter().enumerate().skip(1) {
            publisher
                .send(message(&pod, seq as u64, payload))
                .await
                .expect("send");
        }
        let want = *s.matched_after.last().expect("phases");
        let mut got = 0;
        for _ in 0..200 {
            got = support::matched_blocks(&mut grpc, MODEL, &support::past(&s.tokens), &pod).await;
            if got == want {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert_eq!(got, want, "{}: blocks held after every message", s.name);
    }
    let pods = support::pods::list(&d).await;
    for (i, s) in scenarios.iter().enumerate() {
        let pod = format!("10.9.0.{i}:8000");
        let info = pods.iter().find(|p| p.pod == pod).expect("listed");
        let aligned = s.name.contains("aligned") || s.name.contains("duplicate");
        assert_eq!(
            info.key_mode,
            if aligned { "aligned" } else { "translated" },
            "{}",
            s.name
        );
        assert_eq!(
            info.hash_mismatches, 0,
            "{}: a translated engine is not reported as mismatched",
            s.name
        );
    }
    let page = d.metrics_text();
    let translated = scenarios.len() as f64 - 2.0;
    assert_eq!(
        support::metric(
            &page,
            &format!("kvindexer_engines{{key_mode=\"translated\",model=\"{MODEL}\"}}")
        ),
        translated,
        "{page}"
    );
    d.shutdown().await;
}
