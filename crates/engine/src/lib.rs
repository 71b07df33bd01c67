//! metrale-engine: the PLE part of a model driven as a server drives it.
//!
//! - [`snapshot`]: the self-describing, checksummed container around the
//!   per-site aux blobs of a sequence's carry, and the geometry fingerprint
//!   that decides whether a snapshot fits an engine;
//! - [`prefix_cache`]: a radix tree over token ids holding snapshots at block
//!   boundaries, bounded by bytes with LRU eviction;
//! - [`store`]: prefix carries shared between processes (a directory, Redis)
//!   behind the prefix cache, keyed by model, geometry and token prefix;
//! - [`budget`]: accounting of the device memory held by carries, and the
//!   policy that picks sequences to preempt when it runs short;
//! - [`engine`]: sequences over the PLE sites: add, chunked prefill, batched
//!   decode, speculative verify and commit, swap, release;
//! - [`server`]: the serving loop over an engine: admission, chunked
//!   prefill, batched decode, fault retries, statistics;
//! - [`ple_site`]: the PLE layer as an engine site;
//! - [`backbone`]: GEMM blocks standing in for the model's layers around
//!   the sites, so table reads have compute to hide behind;
//! - [`wrap`]: [`wrap::Wrapped`], a site around another that hands every
//!   call on, with a small middleware where a wrapper changes one (the
//!   backbone's [`backbone::Layered`], a test's hooked site).
//!
//! A site is two traits: [`CarrySite`] (geometry, carries, their blobs)
//! and [`Site`] (a step: plan, prefetch, run, prestage). A step is a value,
//! [`StepPlans`]: [`Engine::plan`] hashes it once at every site, and the
//! engine's prefetch, prefill and decode calls take it.
//!
//! Tiny test models and the other shared test helpers live in the
//! `metrale-testkit` crate, a dev-dependency only.

pub mod backbone;
pub mod budget;
pub mod engine;
pub mod ple_site;
pub mod prefix_cache;
pub mod server;
pub mod snapshot;
pub mod store;
pub mod wrap;

pub use engine::{
    Added, CarrySite, Engine, EngineConfig, EngineError, EngineStats, Highway, Place, SeqId, Site,
    SiteResult, StepPlans, SwapTarget,
};
pub use server::{Server, ServerConfig, ServerError, ServerReport};
