//! The subcommands, one module each, and the error type that carries the
//! exit status: [`CmdError::Input`] (status 2) for anything wrong with
//! what the user gave, [`CmdError::Failure`] (status 1) for everything else.

#[cfg(feature = "bench")]
pub mod bench;
pub mod common;
pub mod faults;
pub mod ids;
pub mod init;
pub mod inspect;
pub mod remote;
pub mod run;
pub mod shard;
pub mod soak;
pub mod table;
pub mod token_map;

use std::fmt;

/// Exit status for usage and input errors.
pub const EXIT_INPUT: u8 = 2;
/// Exit status when valid input could not be processed.
pub const EXIT_FAILURE: u8 = 1;

/// Why a subcommand failed.
#[derive(Debug)]
pub enum CmdError {
    /// The flags, lists or files given are wrong.
    Input(anyhow::Error),
    /// The input was fine but the work failed (e.g. stdout closed).
    Failure(anyhow::Error),
}

impl CmdError {
    /// The process exit status for this error.
    pub fn exit_status(&self) -> u8 {
        match self {
            CmdError::Input(_) => EXIT_INPUT,
            CmdError::Failure(_) => EXIT_FAILURE,
        }
    }
}

impl fmt::Display for CmdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CmdError::Input(e) | CmdError::Failure(e) => write!(f, "{e:#}"),
        }
    }
}

/// Tag an error as an input error.
pub fn input<E: Into<anyhow::Error>>(e: E) -> CmdError {
    CmdError::Input(e.into())
}

/// Tag an error as a failure of the work itself.
pub fn failure<E: Into<anyhow::Error>>(e: E) -> CmdError {
    CmdError::Failure(e.into())
}
