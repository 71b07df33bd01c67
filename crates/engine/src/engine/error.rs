//! [`EngineError`]: every way an engine call can fail, as variants callers
//! match on.
//!
//! Invariants: refusals (unknown sequence, wrong sizes, wrong place, pending
//! verify, budget, snapshot checks) are raised before any state changes;
//! failures of the device or of a site (`Site`, `Device`) may have changed
//! state, and the sequences they touched are then [`EngineError::Lost`] for
//! every later call. Errors of the budget, the prefix cache and the
//! snapshot container keep their own types inside, so the cause is matched
//! without parsing text.

use std::path::PathBuf;

use metrale_gpu_runtime::GpuError;
use thiserror::Error;

use super::SeqId;
use crate::budget::BudgetError;
use crate::prefix_cache::PrefixCacheError;
use crate::snapshot::SnapshotError;

/// An error of a site or of the backend, kept with its chain of causes.
/// Sites and backends report whatever error type they have; the engine
/// only needs to carry it to the caller.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Where a sequence's carry is, as a refused swap reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// On the device.
    Resident,
    /// Swapped out.
    Swapped,
    /// Lost by a failed device operation.
    Lost,
}

impl std::fmt::Display for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Place::Resident => "resident",
            Place::Swapped => "already swapped out",
            Place::Lost => "lost",
        })
    }
}

/// Why an engine call failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum EngineError {
    /// No such sequence.
    #[error("no sequence {0}")]
    UnknownSequence(SeqId),
    /// The highway rows do not match the tokens.
    #[error("{op}: {rows} highway values given for {tokens} tokens of width {width}")]
    HighwaySize {
        /// The operation.
        op: &'static str,
        /// Values given.
        rows: usize,
        /// Tokens given.
        tokens: usize,
        /// Values per token.
        width: usize,
    },
    /// A device highway at the null address for tokens to run.
    #[error("{op}: a null device highway given for {tokens} tokens")]
    NullHighway {
        /// The operation.
        op: &'static str,
        /// Tokens given.
        tokens: usize,
    },
    /// A speculative verify is pending on the sequence.
    #[error("{op}: sequence {seq} has a pending verify; commit it first")]
    PendingVerify {
        /// The operation.
        op: &'static str,
        /// The sequence.
        seq: SeqId,
    },
    /// `commit` without a verify.
    #[error("commit: sequence {0} has no pending verify")]
    NoPendingVerify(SeqId),
    /// More accepted tokens than drafted.
    #[error("commit: sequence {seq} accepted {accepted} of {drafted} draft tokens")]
    TooManyAccepted {
        /// The sequence.
        seq: SeqId,
        /// Tokens accepted.
        accepted: usize,
        /// Tokens drafted.
        drafted: usize,
    },
    /// A sequence appears twice in one batch.
    #[error("decode: sequence {0} appears twice in one batch")]
    DuplicateInBatch(SeqId),
    /// A step plan holds the sequence for other tokens or another
    /// position than the call runs; nothing of the call ran.
    #[error(
        "sequence {seq} was planned for {planned} tokens after {planned_at}, the call runs \
         {tokens} after {absorbed}; plan the step the call runs"
    )]
    PlanMismatch {
        /// The sequence.
        seq: SeqId,
        /// Tokens it had absorbed when planned.
        planned_at: usize,
        /// Tokens planned.
        planned: usize,
        /// Tokens it has absorbed now.
        absorbed: usize,
        /// Tokens the call runs.
        tokens: usize,
    },
    /// A token the sites' hash family cannot take (at or above its
    /// vocabulary); nothing of the call ran.
    #[error(
        "{op}: token {token} at position {position} is not below the {family} vocabulary of {limit} ids"
    )]
    TokenOutOfRange {
        /// The operation.
        op: &'static str,
        /// The token's index in the tokens of the call.
        position: usize,
        /// The token.
        token: u32,
        /// Tokens must be below this.
        limit: u64,
        /// The hash family that sets the limit.
        family: &'static str,
    },
    /// A token mask given to an engine with a site whose published layer
    /// has none (only DeepSeek-V4.1's Engram gate without a short conv
    /// takes one); nothing of the call ran.
    #[error(
        "{op}: site {site} follows the {family} layer, which has no token mask (only \
         DeepSeek-V4.1's Engram gate without a short conv takes one); leave the mask out"
    )]
    TokenMaskUnsupported {
        /// The operation.
        op: &'static str,
        /// The first site that takes no mask.
        site: usize,
        /// Its family, as its published layer is named.
        family: &'static str,
    },
    /// A token mask whose length is not the call's token count; nothing of
    /// the call ran.
    #[error("{op}: {flags} mask flags given for {tokens} tokens; give one flag per token")]
    MaskSize {
        /// The operation.
        op: &'static str,
        /// Flags given.
        flags: usize,
        /// Tokens (decode: sequences) given.
        tokens: usize,
    },
    /// Decode of a sequence that has run no token.
    #[error("decode: sequence {0} has run no token; prefill it first")]
    NotStarted(SeqId),
    /// A snapshot of a sequence that has run no token: there is no carry.
    #[error("snapshot: sequence {0} has run no token")]
    NoTokens(SeqId),
    /// The carry was lost by a failed device operation.
    #[error("sequence {seq}: its carry was lost when {cause}; release it")]
    Lost {
        /// The sequence.
        seq: SeqId,
        /// What failed, with its causes.
        cause: String,
    },
    /// A swap of a sequence in the wrong place.
    #[error("{op}: sequence {seq} is {place}")]
    WrongPlace {
        /// The operation.
        op: &'static str,
        /// The sequence.
        seq: SeqId,
        /// Where it is.
        place: Place,
    },
    /// File swap without a directory.
    #[error("swap to file: no swap directory configured")]
    NoSwapDir,
    /// A snapshot's token count differs from the tokens given with it.
    #[error("snapshot holds the carry of {snapshot} tokens, {given} tokens given")]
    TokenCount {
        /// The snapshot's count.
        snapshot: u64,
        /// Tokens given.
        given: usize,
    },
    /// A snapshot's carried history disagrees with the tokens given with it.
    #[error(
        "snapshot history of site {site} is {snapshot:?}, but the tokens given end in {tokens:?}"
    )]
    HistoryMismatch {
        /// The site.
        site: usize,
        /// The history in the snapshot.
        snapshot: Vec<u32>,
        /// The history the tokens imply.
        tokens: Vec<u32>,
    },
    /// A broken internal invariant; never expected.
    #[error("internal: {0}")]
    Internal(&'static str),
    /// A configuration value is out of range.
    #[error("engine config: {0}")]
    Config(String),
    /// Decode graphs asked of a site that cannot replay them.
    #[error("decode graphs: site {0} cannot replay decode graphs")]
    GraphsUnsupported(usize),
    /// Decode graphs asked of a site whose row table cannot keep one
    /// sequence's rows pinned for a whole step.
    #[error(
        "decode graphs: site {0}'s row table cannot keep one sequence's rows pinned for a step; \
         give its row cache more slots, or decode without graphs"
    )]
    GraphRowsDoNotFit(usize),
    /// The device memory budget refused a charge.
    #[error(transparent)]
    Budget(#[from] BudgetError),
    /// A snapshot was refused: it does not decode or does not fit this
    /// engine's geometry.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// The prefix cache refused an entry.
    #[error(transparent)]
    PrefixCache(#[from] PrefixCacheError),
    /// Making room for a sequence failed while preempting another.
    #[error("preempting sequence {victim} for sequence {seq}")]
    Preempt {
        /// The sequence being swapped out.
        victim: SeqId,
        /// The sequence that needed the room.
        seq: SeqId,
        /// Why the swap-out failed.
        #[source]
        source: Box<EngineError>,
    },
    /// A site refused or failed an operation (the layer, its table, its
    /// kernels).
    #[error("{op}")]
    Site {
        /// The site's index.
        site: usize,
        /// The operation, as text naming the site.
        op: String,
        /// The site's error.
        #[source]
        source: BoxError,
    },
    /// A backend operation the engine issued itself failed (staging copies,
    /// synchronisation, graph capture and launch, frees).
    #[error("{op}")]
    Device {
        /// The operation.
        op: String,
        /// The backend's error (boxed: it is large, and rare).
        #[source]
        source: Box<GpuError>,
    },
    /// Reading, writing or removing a swap file failed.
    #[error("{op}: {}", path.display())]
    SwapFile {
        /// The operation.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A swapped-out snapshot read back from a file was refused.
    #[error("swap_in: {}", path.display())]
    SwapFileSnapshot {
        /// The file.
        path: PathBuf,
        /// Why it was refused.
        #[source]
        source: SnapshotError,
    },
}

impl EngineError {
    /// A site's failure of `op`.
    pub fn site(site: usize, op: impl Into<String>, source: impl Into<BoxError>) -> Self {
        EngineError::Site {
            site,
            op: op.into(),
            source: source.into(),
        }
    }

    /// A backend failure of `op`.
    pub fn device(op: impl Into<String>, source: GpuError) -> Self {
        EngineError::Device {
            op: op.into(),
            source: Box::new(source),
        }
    }

    /// Whether this failure lost (or found lost) a sequence's carry, as
    /// opposed to a refusal that changed nothing.
    pub fn is_lost(&self) -> bool {
        matches!(self, EngineError::Lost { .. })
    }

    /// Whether this came from a site or the backend failing (the cases a
    /// caller may retry after releasing the sequences involved).
    pub fn is_device_failure(&self) -> bool {
        match self {
            EngineError::Site { .. } | EngineError::Device { .. } => true,
            EngineError::Preempt { source, .. } => source.is_device_failure(),
            _ => false,
        }
    }

    /// The message with every cause after it, `: `-separated, as
    /// `anyhow`'s `{:#}` prints a chain.
    pub fn chain(&self) -> String {
        chain(self)
    }
}

/// `err` and its causes, `: `-separated.
pub(crate) fn chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut s = err.to_string();
    let mut cur = err.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Results of engine calls.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_name_every_cause_and_classify_failures() {
        let site = EngineError::site(1, "site 1 forward of 3 tokens", "row 7: short read");
        assert_eq!(
            site.chain(),
            "site 1 forward of 3 tokens: row 7: short read"
        );
        assert!(site.is_device_failure() && !site.is_lost());
        let preempt = EngineError::Preempt {
            victim: 2,
            seq: 5,
            source: Box::new(site),
        };
        assert!(preempt.is_device_failure());
        assert_eq!(
            preempt.chain(),
            "preempting sequence 2 for sequence 5: site 1 forward of 3 tokens: row 7: short read"
        );
        let refused = EngineError::WrongPlace {
            op: "swap_out",
            seq: 3,
            place: Place::Swapped,
        };
        assert_eq!(
            refused.chain(),
            "swap_out: sequence 3 is already swapped out"
        );
        assert!(!refused.is_device_failure());
        let budget = EngineError::from(BudgetError::AlreadyCharged(4));
        assert_eq!(
            budget.to_string(),
            "sequence 4 is already charged to the device memory budget"
        );
    }
}
