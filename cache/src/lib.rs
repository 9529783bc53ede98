//! The cache that survives the job: the HTTP service `actions/cache` speaks — the
//! legacy `_apis/artifactcache` API and the v2 Twirp `CacheService` with its blob
//! uploads — over an object store (a directory on one host, or an S3-compatible bucket
//! several controllers share), scoped the way GitHub scopes its cache.
//!
//! The cache holds no credential and trusts no client for its scope: the controller
//! serves it on the facade's own authenticated transport and hands every request the
//! [`Scope`] of the job that sent it (its repository, the ref it may write, the refs it
//! may read, the job itself), derived from the task Gitea gave that job.
//!
//! One job costs the others little: what its requests may hold — bytes and objects of
//! uploads not committed, open uploads, requests at once, free space — is bounded per
//! job, per repository and in all, and refused with a status and a counted reason past
//! that ([`budget`], [`refusal`]).
//!
//! Layout, each room importing only from the rooms listed after it (this file declares
//! and re-exports, and holds nothing of its own):
//! - [`service`]: the [`Cache`]; a request told apart by [`api`] (the protocol's one
//!   route table, `contract::cache::Call`) and handed to its API's adapter, then the sweep.
//! - [`v1`], [`v2`]: the two APIs' adapters — a request parsed, a room called, its answer
//!   encoded in the API's format; neither knows the other.
//! - [`sweep`]: what goes — past the age limit, over the size limits (least recently
//!   used first), uploads never committed.
//! - [`uploads`]: saves, from reservation to commit, bounded as they go.
//! - [`restore`]: which entry a job's keys find, which archives it may download.
//! - [`download`]: archives streamed.
//! - [`api`]: what a job is told where no cache is kept.
//! - [`lookup`]: which entry a restore gets (pure, table-tested), and what keys may be.
//! - [`scope`], [`budget`]: who asks, and what they may hold.
//! - [`store`]: the objects on the store; the store is the index.
//! - [`backend`]: the storage opened (a directory, or an S3 bucket).
//! - [`http`], [`metrics`], [`error`], [`refusal`]: the plumbing.

#![forbid(unsafe_code)]

pub mod api;
pub mod backend;
pub mod budget;
pub mod download;
pub mod error;
pub mod http;
pub mod lookup;
pub mod metrics;
pub mod refusal;
pub mod restore;
pub mod scope;
pub mod service;
pub mod store;
pub mod sweep;
pub mod uploads;
pub mod v1;
pub mod v2;

pub use crate::{
    error::CacheError,
    http::{BoxError, Response, ResponseBody},
    metrics::CacheMetrics,
    refusal::Refusal,
    scope::{Limits, Scope},
    service::{Cache, Io},
    uploads::KeepFree,
};
