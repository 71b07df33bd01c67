//! [`TableMode`]: how a table's rows are served, the one name for it that
//! the checkpoint loader, the CLI and the engine share.
//!
//! Invariant: [`TableMode::name`], `Display` and `FromStr` agree, and
//! [`TableMode::ALL`] lists every mode, so a command-line parser built from
//! them accepts exactly the modes that exist.

use std::fmt;
use std::str::FromStr;

use crate::error::StorageError;

/// How a table's rows are served (see [`crate::open`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TableMode {
    /// Every row copied to device memory ([`crate::resident::ResidentTable`]).
    Resident,
    /// Shard files memory-mapped and registered
    /// ([`crate::mapped::MappedTable`]).
    Mapped,
    /// Rows read from disk on demand into a slot cache
    /// ([`crate::cached::CachedTable`]).
    Cached,
    /// Rows copied once per host into shared-memory segments that every
    /// process maps ([`crate::shared::SharedTable`]).
    Shared,
}

impl TableMode {
    /// Every mode, in the order help texts list them.
    pub const ALL: [TableMode; 4] = [
        TableMode::Resident,
        TableMode::Mapped,
        TableMode::Cached,
        TableMode::Shared,
    ];

    /// The mode's name: `resident`, `mapped`, `cached` or `shared`.
    pub fn name(self) -> &'static str {
        match self {
            TableMode::Resident => "resident",
            TableMode::Mapped => "mapped",
            TableMode::Cached => "cached",
            TableMode::Shared => "shared",
        }
    }

    /// Every mode's name, in the order of [`Self::ALL`].
    pub fn names() -> [&'static str; 4] {
        Self::ALL.map(Self::name)
    }
}

impl fmt::Display for TableMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for TableMode {
    type Err = StorageError;

    /// Parse a mode name (ASCII case-insensitive).
    fn from_str(s: &str) -> Result<Self, StorageError> {
        Self::ALL
            .into_iter()
            .find(|m| m.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                StorageError::invalid(format!(
                    "unknown table mode '{s}' (expected one of: {})",
                    Self::names().join(", ")
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        for m in TableMode::ALL {
            assert_eq!(m.to_string().parse::<TableMode>().unwrap(), m);
        }
        assert_eq!("Cached".parse::<TableMode>().unwrap(), TableMode::Cached);
        let e = "disk".parse::<TableMode>().unwrap_err().to_string();
        assert!(
            e.contains("'disk'") && e.contains("resident, mapped, cached, shared"),
            "{e}"
        );
    }
}
