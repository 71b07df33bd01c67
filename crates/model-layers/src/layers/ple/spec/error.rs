//! [`SpecError`]: why a model or site description was refused.

use super::*;

/// Why a model or site description was refused. Every variant that comes
/// from a config file names it, and every field error names the field.
#[derive(Debug, Error)]
pub enum SpecError {
    /// The config file could not be read.
    #[error("cannot read config {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The operating-system error.
        #[source]
        source: std::io::Error,
    },
    /// The text is not JSON.
    #[error("{file}: not valid JSON: {msg}")]
    Json {
        /// The source the text came from.
        file: String,
        /// The parser's message.
        msg: String,
    },
    /// The JSON is not an object.
    #[error("{file}: the top level must be a JSON object")]
    NotObject {
        /// The source the text came from.
        file: String,
    },
    /// A required field is absent or null.
    #[error("{file}: missing required field `{field}`")]
    Missing {
        /// The source the text came from.
        file: String,
        /// The field.
        field: String,
    },
    /// A field has the wrong type or is out of range.
    #[error("{file}: field `{field}` {problem}")]
    Field {
        /// The source the text came from.
        file: String,
        /// The field (with an index for list entries, e.g. `ple_layer_ids[1]`).
        field: String,
        /// What is wrong with it, e.g. "must be at least 1, got 0".
        problem: String,
    },
    /// A size derived from the fields does not fit an allocation.
    #[error("{file}: {what} is too large to address")]
    TooLarge {
        /// The source the text came from.
        file: String,
        /// The expression, naming the fields it is computed from.
        what: &'static str,
    },
    /// A site index past `ple_layer_ids`.
    #[error("PLE site {site} does not exist: ple_layer_ids has {count} entries ({ids:?})")]
    NoSuchSite {
        /// The index asked for.
        site: usize,
        /// How many sites there are.
        count: usize,
        /// `ple_layer_ids`.
        ids: Vec<usize>,
    },
    /// A site's hash constants do not derive.
    #[error("site {site} (layer id {layer_id}): {source}")]
    Derive {
        /// The site index.
        site: usize,
        /// Its 1-based layer id.
        layer_id: usize,
        /// Why.
        #[source]
        source: IdError,
    },
    /// A [`SiteSpec`] field a layer cannot be built with.
    #[error("PLE {field} {problem}")]
    Site {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// A token map file that does not fit the config.
    #[error("token map {file}: {problem}")]
    TokenMap {
        /// The file (or text source) of the map.
        file: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A [`SiteSpec`]'s hash constants are unusable.
    #[error(transparent)]
    Ids(#[from] IdError),
}
