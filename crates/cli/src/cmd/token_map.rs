//! `metrale-ple token-map`: build Engram's compressed-token map from a
//! Hugging Face `tokenizer.json`, as the Engram demo does (docs/SPEC.md
//! §11), and write it as the JSON array `--token-map` reads.
//!
//! Without `-o` the array goes to stdout. With `-o PATH` it goes to PATH
//! (written to a temporary file beside it, then renamed, so a reader never
//! sees half a map) and stdout gets one JSON object: `tokenizer`, `output`,
//! `raw_vocab_size` and `compressed_vocab_size` (V', the value an Engram
//! config states as `engram_compressed_vocab_size`).

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use clap::Args;
use metrale_model_layers::layers::ple::family::engram::token_map_from_tokenizer_json;
use serde_json::json;

use super::{CmdError, failure, input};

/// Flags of `metrale-ple token-map`.
#[derive(Args, Debug)]
#[command(
    after_help = "Examples:\n  metrale-ple token-map tokenizer.json -o map.json\n  metrale-ple ids --config config.json --token-map map.json --tokens 5,6"
)]
pub struct TokenMapArgs {
    /// The tokenizer.json to build the map from.
    #[arg(value_name = "TOKENIZER")]
    tokenizer: PathBuf,
    /// Write the map (a JSON array, entry t the compressed id of raw token
    /// t) here instead of stdout.
    #[arg(short, long, value_name = "PATH")]
    output: Option<PathBuf>,
}

/// The map as one line of JSON.
fn array_text(map: &[u32]) -> String {
    let mut s = String::with_capacity(map.len() * 7 + 2);
    s.push('[');
    for (i, v) in map.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&v.to_string());
    }
    s.push_str("]\n");
    s
}

/// Write `text` to `path` through a temporary file in the same directory,
/// renamed over `path` once complete (and removed if anything fails).
fn write_atomically(path: &Path, text: &str) -> anyhow::Result<()> {
    let name = path
        .file_name()
        .with_context(|| format!("{} names no file", path.display()))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".{}.tmp", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let written = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("cannot write {}", path.display()));
    }
    Ok(())
}

/// Run `metrale-ple token-map`.
pub fn run(args: &TokenMapArgs) -> Result<(), CmdError> {
    let built = token_map_from_tokenizer_json(&args.tokenizer).map_err(input)?;
    let text = array_text(&built.map);
    let mut stdout = std::io::stdout().lock();
    let printed = match &args.output {
        None => stdout.write_all(text.as_bytes()),
        Some(path) => {
            write_atomically(path, &text).map_err(failure)?;
            let summary = json!({
                "tokenizer": args.tokenizer.display().to_string(),
                "output": path.display().to_string(),
                "raw_vocab_size": built.map.len(),
                "compressed_vocab_size": built.compressed_vocab_size(),
            });
            writeln!(stdout, "{summary}")
        }
    };
    printed
        .and_then(|()| stdout.flush())
        .context("cannot write to stdout")
        .map_err(CmdError::Failure)
}
