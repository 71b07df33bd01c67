//! A row table that forwards every call to another and runs a hook on each
//! resolve (to count or log them), optionally reporting that every resolve
//! would wait for reads, so a layer over it takes its pipelined path.
//!
//! Invariant: apart from the hook and that one answer, it behaves exactly
//! as the table it wraps: rows, leases, limits and counters are the
//! inner table's.

use std::sync::Arc;

use metrale_gpu_runtime::gpu::{EventHandle, GpuBackend};
use metrale_storage::Result;
use metrale_storage::table::{Lease, RowRef, RowTable, TableInfo, TableStats};

/// What runs on each resolve: the ids asked for.
type Hook = Box<dyn Fn(&[u64]) + Send + Sync>;

/// [`RowTable`] over `inner`, with a hook on each resolve.
pub struct HookedTable {
    inner: Arc<dyn RowTable>,
    hook: Hook,
    always_waits: bool,
}

impl HookedTable {
    /// Forward to `inner`, calling `hook` with the ids of each resolve
    /// before it runs.
    pub fn new(inner: Arc<dyn RowTable>, hook: impl Fn(&[u64]) + Send + Sync + 'static) -> Self {
        HookedTable {
            inner,
            hook: Box::new(hook),
            always_waits: false,
        }
    }

    /// Report that every resolve would wait for reads
    /// ([`RowTable::would_wait`]), whatever the inner table holds.
    pub fn always_waiting(mut self) -> Self {
        self.always_waits = true;
        self
    }
}

impl RowTable for HookedTable {
    fn info(&self) -> TableInfo {
        self.inner.info()
    }
    fn max_resolve(&self) -> usize {
        self.inner.max_resolve()
    }
    fn max_pinned(&self) -> usize {
        self.inner.max_pinned()
    }
    fn would_wait(&self, ids: &[u64]) -> bool {
        self.always_waits || self.inner.would_wait(ids)
    }
    fn resolve(&self, ids: &[u64], out: &mut [RowRef]) -> Result<Lease> {
        (self.hook)(ids);
        self.inner.resolve(ids, out)
    }
    fn release(
        &self,
        lease: Lease,
        gpu: &dyn GpuBackend,
        after: Option<EventHandle>,
    ) -> Result<()> {
        self.inner.release(lease, gpu, after)
    }
    fn prefetch(&self, ids: &[u64]) -> Result<()> {
        self.inner.prefetch(ids)
    }
    fn stats(&self) -> TableStats {
        self.inner.stats()
    }
}
