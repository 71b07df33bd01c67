//! A row table that serves another's rows and runs a hook on each resolve
//! (to count or log them), optionally reporting that every resolve would
//! wait for reads, so a layer over it takes its pipelined path.
//!
//! Invariant: apart from the hook and that one answer, it behaves exactly
//! as the table it wraps: it is a storage [`Decorated`] table, whose rows,
//! leases, limits and counters are the inner table's.

use std::sync::Arc;

use metrale_storage::idmap::{Decorated, Decoration};
use metrale_storage::table::RowTable;

/// What runs on each resolve: the ids asked for.
type HookFn = Box<dyn Fn(&[u64]) + Send + Sync>;

/// The decoration of a [`HookedTable`]: the hook, and whether every
/// resolve is reported as waiting.
pub struct Hook {
    hook: HookFn,
    always_waits: bool,
}

impl Decoration for Hook {
    fn on_resolve(&self, ids: &[u64]) {
        (self.hook)(ids)
    }
    fn always_waits(&self) -> bool {
        self.always_waits
    }
}

/// [`RowTable`] over another, with a hook on each resolve.
pub type HookedTable = Decorated<Hook>;

/// Serve `inner`'s rows, calling `hook` with the ids of each resolve
/// before it runs.
pub fn hooked(
    inner: Arc<dyn RowTable>,
    hook: impl Fn(&[u64]) + Send + Sync + 'static,
) -> HookedTable {
    hook_table(inner, hook, false)
}

/// [`hooked`], reporting that every resolve would wait for reads
/// ([`RowTable::would_wait`]), whatever the inner table holds.
pub fn hooked_waiting(
    inner: Arc<dyn RowTable>,
    hook: impl Fn(&[u64]) + Send + Sync + 'static,
) -> HookedTable {
    hook_table(inner, hook, true)
}

/// `inner` behind a [`Hook`]; `always_waits` as [`hooked_waiting`] says.
fn hook_table(
    inner: Arc<dyn RowTable>,
    hook: impl Fn(&[u64]) + Send + Sync + 'static,
    always_waits: bool,
) -> HookedTable {
    Decorated::new(
        inner,
        Hook {
            hook: Box::new(hook),
            always_waits,
        },
    )
}
