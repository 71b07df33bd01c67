//! The error type of the id hash: why dims, parameters, buffers or an
//! output slice were refused.
//!
//! Each variant is one kind of refusal; its message is complete on its own
//! (it names the field, parameter or buffer and both values), so callers
//! can show it as is or match on the variant.

use thiserror::Error;

/// Why an id-hash operation was refused.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum IdError {
    /// [`super::PleIdDims`] that do not describe a usable hash.
    #[error("{0}")]
    Dims(String),
    /// A hash parameter out of range, or a derivation that overflows.
    #[error("{0}")]
    Params(String),
    /// A checkpoint's stored constant buffer differs from the derivation.
    #[error("{0}")]
    StoredBuffer(String),
    /// An output or history slice of the wrong length.
    #[error("{0}")]
    Shape(String),
    /// A token at or above the family's vocabulary (Engram, LongCat).
    #[error(
        "{family} hash: {input}[{position}] = {token} is not below the vocabulary of {limit} ids"
    )]
    TokenOutOfRange {
        /// The hash family.
        family: &'static str,
        /// Which input: `tokens`, `history` or `histories`.
        input: &'static str,
        /// The token's index in that input.
        position: usize,
        /// The token.
        token: u32,
        /// Tokens must be below this.
        limit: u64,
    },
    /// The ids reach past the end of the table.
    #[error("PLE ids reach row {last} but the table has only {rows} rows")]
    TableRows {
        /// The largest id the dims can produce.
        last: u64,
        /// Rows in the table.
        rows: u64,
    },
}

/// `ensure!` for [`IdError`]: return `Err(IdError::$kind(format!(...)))`
/// unless `$cond` holds.
macro_rules! id_ensure {
    ($cond:expr, $kind:ident, $($arg:tt)+) => {
        if !$cond {
            return Err($crate::layers::ple::ids::IdError::$kind(format!($($arg)+)));
        }
    };
}

/// `bail!` for [`IdError`].
macro_rules! id_bail {
    ($kind:ident, $($arg:tt)+) => {
        return Err($crate::layers::ple::ids::IdError::$kind(format!($($arg)+)))
    };
}

pub(crate) use {id_bail, id_ensure};
