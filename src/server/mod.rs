//! The daemon's network servers: gRPC (scoring, admin, health, reflection) and HTTP (metrics and
//! probes). The gRPC services are split by operation: [`grpc`] (the front: shared state,
//! admission, deadlines), `score` (ScorePods), [`routing`] (prompt keys, RecordRouting),
//! `admin` (ListPods, ClearPod), `llmd` (llm-d's GetPodScores).

mod admin;
pub mod grpc;
pub mod http;
pub mod llmd;
pub mod routing;
mod score;
