//! The golden fixtures under the repository's `fixtures/` directory, which
//! the numpy code in `reference/` writes, and readers for the JSON arrays
//! they hold.
//!
//! Every reader panics naming what is wrong: a fixture that cannot be read
//! or does not hold what a test expects is a broken test, not a case to
//! recover from.

use std::path::PathBuf;

use serde_json::Value;

/// `fixtures/<sub>` of the repository.
pub fn fixtures_dir(sub: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(sub)
}

/// The JSON document `fixtures/<sub>/<name>`.
pub fn read_json(sub: &str, name: &str) -> Value {
    let path = fixtures_dir(sub).join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

/// A JSON array of unsigned integers.
pub fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("u64"))
        .collect()
}

/// A JSON array of integers that fit a `u32`.
pub fn u32s(v: &Value) -> Vec<u32> {
    u64s(v)
        .into_iter()
        .map(|x| u32::try_from(x).expect("u32"))
        .collect()
}

/// A JSON array of signed integers.
pub fn i64s(v: &Value) -> Vec<i64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_i64().expect("i64"))
        .collect()
}
