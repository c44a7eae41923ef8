//! Why a load run failed: one kind per thing it talks to (flags, ZMQ, gRPC, HTTP, files,
//! tokenizers), each naming the endpoint or file.

use kv_core::TokenProcessorError;
use thiserror::Error;

/// Why a load run failed.
#[derive(Debug, Error)]
pub enum LoadgenError {
    /// Flags out of range.
    #[error("{0}")]
    InvalidArgs(&'static str),
    /// The block size or seed cannot hash prompts.
    #[error("hashing settings: {0}")]
    Hashing(#[from] TokenProcessorError),
    /// The async runtime could not start.
    #[error("starting the runtime: {0}")]
    Runtime(std::io::Error),
    /// The daemon's ZMQ endpoint could not be reached, or a send failed.
    #[error("ZMQ {endpoint}: {source}")]
    Zmq {
        /// The daemon's ZMQ endpoint.
        endpoint: String,
        /// Why.
        source: zeromq::ZmqError,
    },
    /// The daemon's gRPC endpoint could not be reached.
    #[error("connecting to gRPC {endpoint}: {source}")]
    Grpc {
        /// The address.
        endpoint: String,
        /// Why.
        source: tonic::transport::Error,
    },
    /// A ScorePods call failed (other than NOT_FOUND before the first events).
    #[error("ScorePods failed: {0}")]
    Score(tonic::Status),
    /// The metrics port could not be read.
    #[error("reading the metrics port {addr}: {source}")]
    Metrics {
        /// The address.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
    /// The request dump could not be written.
    #[error("writing {path}: {source}")]
    Dump {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A load task ended abnormally.
    #[error("a load task failed: {0}")]
    Task(String),
    /// `--chat-tokenizer`'s tokenizer could not be loaded.
    #[error("the chat tokenizer: {0}")]
    Tokenizer(#[from] kv_tokenize::LoadError),
    /// A chat prompt could not be rendered or encoded.
    #[error("rendering a chat prompt: {0}")]
    Chat(#[from] kv_tokenize::ChatError),
    /// The picks never found a prefix in the index: the benchmark would measure nothing.
    #[error("no prefix matched: {0}")]
    NoPrefixMatches(String),
}
