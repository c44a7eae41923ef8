//! The daemon's network servers: gRPC (scoring, admin, health, reflection) and HTTP (metrics and
//! probes). The gRPC services map their protocol onto the daemon's scoring (`crate::scoring`):
//! [`grpc`] (the front: ScorePods, RecordRouting, the mapping of types and errors, deadlines),
//! `admin` (ListPods, ClearPod), `llmd` (llm-d's GetPodScores).

mod admin;
pub mod grpc;
pub mod http;
pub mod llmd;
