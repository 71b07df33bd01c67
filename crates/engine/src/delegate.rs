//! [`delegate_site!`](crate::delegate_site): the methods of a wrapper site
//! ([`CarrySite`](crate::engine::CarrySite) and [`Site`](crate::Site)) that
//! hand each call to a field unchanged.
//!
//! A wrapper site (the backbone's `Layered`, a test's hooked site) changes a
//! few calls (the runs it times or fails) and must pass every other one on,
//! or the wrapped site silently loses its plans, graphs or counters to the
//! trait's defaults. Naming the passed-on methods in one macro call keeps
//! their signatures in one place, beside the traits. The runs themselves
//! (`run`, `run_batch`) are what wrappers change, so they have no arm.

/// The types the expansion of [`delegate_site!`](crate::delegate_site)
/// names, so a caller needs no imports of its own.
#[doc(hidden)]
pub mod types {
    pub use crate::SiteResult;
    pub use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};
    pub use metrale_model_layers::layers::ple::{SeqWork, SiteSpec};
    pub use metrale_storage::table::TableStats;
}

/// Inside an `impl CarrySite for Wrapper` or `impl Site for Wrapper`,
/// implements each named method of that trait by calling the same method of
/// `self.$field` with the same arguments:
/// `delegate_site!(inner: geometry, snapshot, restore);`. Any method but
/// `run` and `run_batch` may be named; the wrapper writes the others
/// itself.
#[macro_export]
macro_rules! delegate_site {
    ($f:ident: $($method:ident),+ $(,)?) => {
        $( $crate::delegate_site!(@one $f $method); )+
    };
    (@one $f:ident geometry) => {
        fn geometry(&self) -> $crate::delegate::types::SiteSpec {
            self.$f.geometry()
        }
    };
    (@one $f:ident max_tokens) => {
        fn max_tokens(&self) -> usize {
            self.$f.max_tokens()
        }
    };
    (@one $f:ident carry_bytes) => {
        fn carry_bytes(&self) -> usize {
            self.$f.carry_bytes()
        }
    };
    (@one $f:ident new_state) => {
        fn new_state(
            &self,
            gpu: &dyn $crate::delegate::types::GpuBackend,
        ) -> $crate::delegate::types::SiteResult<Self::State> {
            self.$f.new_state(gpu)
        }
    };
    (@one $f:ident snapshot) => {
        fn snapshot(
            &self,
            st: &Self::State,
            gpu: &dyn $crate::delegate::types::GpuBackend,
            stream: $crate::delegate::types::StreamId,
        ) -> $crate::delegate::types::SiteResult<Vec<u8>> {
            self.$f.snapshot(st, gpu, stream)
        }
    };
    (@one $f:ident restore) => {
        fn restore(
            &self,
            st: &mut Self::State,
            blob: &[u8],
            gpu: &dyn $crate::delegate::types::GpuBackend,
            stream: $crate::delegate::types::StreamId,
        ) -> $crate::delegate::types::SiteResult<()> {
            self.$f.restore(st, blob, gpu, stream)
        }
    };
    (@one $f:ident release) => {
        fn release(
            &self,
            st: &mut Self::State,
            gpu: &dyn $crate::delegate::types::GpuBackend,
        ) -> $crate::delegate::types::SiteResult<()> {
            self.$f.release(st, gpu)
        }
    };
    (@one $f:ident free) => {
        fn free(
            &mut self,
            gpu: &dyn $crate::delegate::types::GpuBackend,
        ) -> $crate::delegate::types::SiteResult<()> {
            self.$f.free(gpu)
        }
    };
    (@one $f:ident supports_graphs) => {
        fn supports_graphs(&self) -> bool {
            self.$f.supports_graphs()
        }
    };
    (@one $f:ident max_prestage_batch) => {
        fn max_prestage_batch(&self) -> Option<usize> {
            self.$f.max_prestage_batch()
        }
    };
    (@one $f:ident forward_prestaged) => {
        fn forward_prestaged(
            &self,
            states: &mut [&mut Self::State],
            highway: $crate::delegate::types::DevicePtr,
            rows: usize,
            gpu: &dyn $crate::delegate::types::GpuBackend,
            stream: $crate::delegate::types::StreamId,
        ) -> $crate::delegate::types::SiteResult<()> {
            self.$f.forward_prestaged(states, highway, rows, gpu, stream)
        }
    };
    (@one $f:ident note_replayed) => {
        fn note_replayed(
            &self,
            states: &mut [&mut Self::State],
            gpu: &dyn $crate::delegate::types::GpuBackend,
            stream: $crate::delegate::types::StreamId,
        ) -> $crate::delegate::types::SiteResult<()> {
            self.$f.note_replayed(states, gpu, stream)
        }
    };
    (@one $f:ident rearm) => {
        fn rearm(&self, st: &mut Self::State) {
            self.$f.rearm(st)
        }
    };
    (@one $f:ident history) => {
        fn history<'s>(&self, st: &'s Self::State) -> &'s [u32] {
            self.$f.history(st)
        }
    };
    (@one $f:ident plan) => {
        fn plan(
            &self,
            work: &[$crate::delegate::types::SeqWork<'_>],
        ) -> $crate::delegate::types::SiteResult<Self::Plan> {
            self.$f.plan(work)
        }
    };
    (@one $f:ident prefetch) => {
        fn prefetch(&self, plan: &Self::Plan) -> $crate::delegate::types::SiteResult<()> {
            self.$f.prefetch(plan)
        }
    };
    (@one $f:ident prestage) => {
        fn prestage(
            &self,
            plan: &Self::Plan,
            seqs: &[usize],
            states: &mut [&mut Self::State],
            rows: usize,
            gpu: &dyn $crate::delegate::types::GpuBackend,
            stream: $crate::delegate::types::StreamId,
        ) -> $crate::delegate::types::SiteResult<()> {
            self.$f.prestage(plan, seqs, states, rows, gpu, stream)
        }
    };
    (@one $f:ident table_stats) => {
        fn table_stats(&self) -> $crate::delegate::types::TableStats {
            self.$f.table_stats()
        }
    };
}
