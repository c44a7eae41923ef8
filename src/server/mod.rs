//! The daemon's network servers: gRPC (scoring, admin, health, reflection) and HTTP (metrics and
//! probes).

pub mod grpc;
pub mod http;
pub mod routing;
