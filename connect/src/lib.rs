//! The Connect protocol, unary calls only, over HTTP/1.1 — what Gitea and an
//! unmodified gitea-runner speak (connect-go on both sides).
//!
//! - [`client`]: used by the controller as a client of Gitea.
//! - [`server`]: used by the supervisor to serve the loopback RunnerService.
//! - [`codec`]: `application/proto` and `application/json` (proto3 JSON mapping).
//! - [`code`] and [`error`]: Connect error codes, their HTTP statuses and JSON bodies.
//! - [`protocol`]: headers, `Connect-Timeout-Ms`, gzip.
//!
//! Why not the `connectrpc` crate: its messages are buffa types, while the rest of the
//! workspace (tonic for the facade, the `spiffe` crate) is built on prost; unary
//! Connect over HTTP/1.1 is small enough to carry here on hyper.

#![forbid(unsafe_code)]

pub mod client;
pub mod code;
pub mod codec;
pub mod error;
pub mod protocol;
pub mod server;

pub use client::{CallOptions, Client};
pub use code::Code;
pub use codec::{Codec, Message};
pub use error::ConnectError;
pub use server::{BoxBody, Fallback, Request, Response, Router, serve, serve_with_fallback};
