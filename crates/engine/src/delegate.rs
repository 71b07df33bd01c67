//! [`delegate_site!`](crate::delegate_site): the [`Site`](crate::Site)
//! methods of a wrapper site that hand each call to a field unchanged.
//!
//! A wrapper site (the backbone's `Layered`, a test's hooked site) changes a
//! few calls and must pass every other one on, or the wrapped site silently
//! loses its prefetches, graphs or counters to the trait's defaults. Naming
//! the passed-on methods in one macro call keeps their signatures in one
//! place, beside the trait, instead of one copy in each wrapper.

/// The types the expansion of [`delegate_site!`](crate::delegate_site)
/// names, so a caller needs no imports of its own.
#[doc(hidden)]
pub mod types {
    pub use crate::SiteResult;
    pub use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};
    pub use metrale_model_layers::layers::ple::SiteSpec;
    pub use metrale_storage::table::TableStats;
}

/// Inside an `impl Site for Wrapper`, implements each named method by calling
/// the same method of `self.$field` with the same arguments:
/// `delegate_site!(inner: geometry, snapshot, restore);`. Any method of
/// [`Site`](crate::Site) may be named; the wrapper writes the others itself.
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
    (@one $f:ident forward) => {
        fn forward(
            &self,
            st: &mut Self::State,
            tokens: &[u32],
            highway: $crate::delegate::types::DevicePtr,
            fresh: bool,
            gpu: &dyn $crate::delegate::types::GpuBackend,
            stream: $crate::delegate::types::StreamId,
        ) -> $crate::delegate::types::SiteResult<()> {
            self.$f.forward(st, tokens, highway, fresh, gpu, stream)
        }
    };
    (@one $f:ident forward_batch) => {
        fn forward_batch(
            &self,
            states: &mut [&mut Self::State],
            tokens: &[u32],
            highway: $crate::delegate::types::DevicePtr,
            gpu: &dyn $crate::delegate::types::GpuBackend,
            stream: $crate::delegate::types::StreamId,
        ) -> $crate::delegate::types::SiteResult<()> {
            self.$f.forward_batch(states, tokens, highway, gpu, stream)
        }
    };
    (@one $f:ident forward_masked) => {
        fn forward_masked(
            &self,
            st: &mut Self::State,
            tokens: &[u32],
            masked: &[bool],
            highway: $crate::delegate::types::DevicePtr,
            fresh: bool,
            gpu: &dyn $crate::delegate::types::GpuBackend,
            stream: $crate::delegate::types::StreamId,
        ) -> $crate::delegate::types::SiteResult<()> {
            self.$f.forward_masked(st, tokens, masked, highway, fresh, gpu, stream)
        }
    };
    (@one $f:ident forward_batch_masked) => {
        fn forward_batch_masked(
            &self,
            states: &mut [&mut Self::State],
            tokens: &[u32],
            masked: &[bool],
            highway: $crate::delegate::types::DevicePtr,
            gpu: &dyn $crate::delegate::types::GpuBackend,
            stream: $crate::delegate::types::StreamId,
        ) -> $crate::delegate::types::SiteResult<()> {
            self.$f.forward_batch_masked(states, tokens, masked, highway, gpu, stream)
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
    (@one $f:ident prestage_batch) => {
        fn prestage_batch(
            &self,
            states: &mut [&mut Self::State],
            tokens: &[u32],
            rows: usize,
            gpu: &dyn $crate::delegate::types::GpuBackend,
            stream: $crate::delegate::types::StreamId,
        ) -> $crate::delegate::types::SiteResult<()> {
            self.$f.prestage_batch(states, tokens, rows, gpu, stream)
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
    (@one $f:ident prefetch) => {
        fn prefetch(
            &self,
            history: &[u32],
            tokens: &[u32],
        ) -> $crate::delegate::types::SiteResult<()> {
            self.$f.prefetch(history, tokens)
        }
    };
    (@one $f:ident prefetch_step) => {
        fn prefetch_step(
            &self,
            work: &[(&[u32], &[u32])],
        ) -> $crate::delegate::types::SiteResult<()> {
            self.$f.prefetch_step(work)
        }
    };
    (@one $f:ident prefetch_ahead) => {
        fn prefetch_ahead(
            &self,
            work: &[(&[u32], &[u32])],
        ) -> $crate::delegate::types::SiteResult<()> {
            self.$f.prefetch_ahead(work)
        }
    };
    (@one $f:ident table_stats) => {
        fn table_stats(&self) -> $crate::delegate::types::TableStats {
            self.$f.table_stats()
        }
    };
}
