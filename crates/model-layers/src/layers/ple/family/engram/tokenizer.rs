//! Engram's compressed-token map built from a Hugging Face `tokenizer.json`
//! (docs/SPEC.md §11, "Token map"), as the Engram demo's
//! `CompressedTokenizer` builds it, through the `tokenizers` library
//! itself: its reader, its `decode` and its normalisers.
//!
//! For each raw id `0..len` (`len` the number of distinct token strings of
//! the model's vocabulary and the added tokens, what `len(tokenizer)`
//! gives): decode the id alone (`decode([id], skip_special_tokens=False)`);
//! when the text holds U+FFFD the key is the raw token string, otherwise
//! the normalised text, or the text itself when that is empty. Compressed
//! ids are handed out in the order keys are first seen.
//!
//! The normaliser is the demo's `tokenizers` sequence: NFKC, NFD,
//! StripAccents, Lowercase, `[ \t\r\n]+` to one space, a text that is
//! exactly one space to U+E000, Strip, U+E000 back to a space.
//!
//! Invariants: a file the library cannot read is refused with an error
//! naming the file, never a panic; the map has one entry per raw id and its
//! entries are exactly `0..V'` (every compressed id is used).

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::path::{Path, PathBuf};

use thiserror::Error;
use tokenizers::normalizers::replace::ReplacePattern;
use tokenizers::normalizers::{Lowercase, NFD, NFKC, Replace, Sequence, Strip, StripAccents};
use tokenizers::{Model, NormalizedString, Normalizer, Tokenizer};

use super::super::TokenMap;

/// Why a `tokenizer.json` could not be turned into a token map.
#[derive(Debug, Error)]
pub enum TokenizerJsonError {
    /// The file could not be read.
    #[error("cannot read tokenizer {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The operating-system error.
        #[source]
        source: std::io::Error,
    },
    /// The text is not a tokenizer the library reads (not JSON, a field
    /// missing or of the wrong type, an unknown model or decoder).
    #[error("tokenizer {file}: {msg}")]
    Json {
        /// The file (or text source).
        file: String,
        /// The reader's message, with the line and column.
        msg: String,
    },
    /// The library gave up on a value it does not check (it panicked);
    /// nothing was built.
    #[error("tokenizer {file}: the tokenizers library cannot read it: {msg}")]
    Library {
        /// The file (or text source).
        file: String,
        /// The library's panic message.
        msg: String,
    },
    /// Two tokens of the model's vocabulary have one id.
    #[error("tokenizer {file}: model vocabulary: id {id} is both {first:?} and {second:?}")]
    SharedId {
        /// The file (or text source).
        file: String,
        /// The id.
        id: u32,
        /// One token holding it (the smaller of the two).
        first: String,
        /// Another token holding it.
        second: String,
    },
    /// The library refused to decode or normalise one id.
    #[error("tokenizer {file}: id {id}: {msg}")]
    Decode {
        /// The file (or text source).
        file: String,
        /// The raw id.
        id: u32,
        /// The library's message.
        msg: String,
    },
}

/// A compressed vocabulary: the map from raw ids and the key of each
/// compressed id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompressedTokens {
    /// Entry `t` is the compressed id of raw token `t`.
    pub map: TokenMap,
    /// Entry `c` is the key that compressed id `c` stands for; its length
    /// is V'.
    pub keys: Vec<String>,
}

impl CompressedTokens {
    /// V': the number of compressed ids.
    pub fn compressed_vocab_size(&self) -> u64 {
        self.keys.len() as u64
    }
}

/// Build the compressed-token map of the tokenizer in `path`.
pub fn token_map_from_tokenizer_json(path: &Path) -> Result<CompressedTokens, TokenizerJsonError> {
    let text = std::fs::read_to_string(path).map_err(|source| TokenizerJsonError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    token_map_from_tokenizer_str(&text, &path.display().to_string())
}

/// [`token_map_from_tokenizer_json`] from text; `source` names it in errors.
pub fn token_map_from_tokenizer_str(
    text: &str,
    source: &str,
) -> Result<CompressedTokens, TokenizerJsonError> {
    let json = |e: serde_json::Error| TokenizerJsonError::Json {
        file: source.to_string(),
        msg: e.to_string(),
    };
    // Syntax first: the library reads some parts through untagged enums
    // and `expect`s them, so a syntax error inside a decoder panics there
    // (tokenizers 0.23, `decoders/mod.rs`). Valid JSON it reads again from
    // the text, so its errors keep their line and column.
    serde_json::from_str::<serde_json::Value>(text).map_err(json)?;
    // The library still `expect`s a few values it reads (a `Precompiled`
    // normaliser's charsmap): its panic becomes this file's error.
    let tok: Tokenizer = std::panic::catch_unwind(|| serde_json::from_str(text))
        .map_err(|panic| TokenizerJsonError::Library {
            file: source.to_string(),
            msg: panic_message(panic.as_ref()),
        })?
        .map_err(json)?;
    let fail = |id: u32, e: tokenizers::Error| TokenizerJsonError::Decode {
        file: source.to_string(),
        id,
        msg: e.to_string(),
    };
    // The library keeps the reverse of a vocabulary in a hash map, so an
    // id two strings claim decodes to either one, differently from run to
    // run: such a vocabulary has no one token map.
    let vocab = tok.get_model().get_vocab();
    let mut held: Vec<(u32, &str)> = vocab.iter().map(|(t, &id)| (id, t.as_ref())).collect();
    held.sort_unstable();
    let clash = held
        .windows(2)
        .find(|w| w[0].0 == w[1].0)
        .map(|w| (w[0].0, w[0].1.to_string(), w[1].1.to_string()));
    if let Some((id, first, second)) = clash {
        return Err(TokenizerJsonError::SharedId {
            file: source.to_string(),
            id,
            first,
            second,
        });
    }
    let norm = key_normalizer();
    let len = tok.get_vocab_size(true);
    let mut index: HashMap<String, u32> = HashMap::new();
    let mut keys = Vec::new();
    let mut map = Vec::with_capacity(len);
    for id in 0..len {
        // Ids are u32 in the library, so its vocabulary size fits one.
        let id = id as u32;
        let text = tok.decode(&[id], false).map_err(|e| fail(id, e))?;
        let key = if text.contains('\u{FFFD}') {
            tok.id_to_token(id).unwrap_or_default()
        } else {
            let mut n = NormalizedString::from(text.as_str());
            norm.normalize(&mut n).map_err(|e| fail(id, e))?;
            if n.get().is_empty() {
                text
            } else {
                n.get().to_string()
            }
        };
        let next = keys.len() as u32;
        let c = match index.entry(key) {
            Entry::Occupied(e) => *e.get(),
            Entry::Vacant(e) => {
                keys.push(e.key().clone());
                e.insert(next);
                next
            }
        };
        map.push(c);
    }
    Ok(CompressedTokens {
        map: map.into(),
        keys,
    })
}

/// The text of a caught panic's payload.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string())
}

/// The demo's private-use stand-in for a lone space.
const SENTINEL: &str = "\u{E000}";

/// The demo's key normaliser, built from the library as the demo builds it.
fn key_normalizer() -> Sequence {
    let regex = |pattern: &str, content: &str| {
        Replace::new(ReplacePattern::Regex(pattern.into()), content)
            .expect("the patterns are valid regexes")
    };
    Sequence::new(vec![
        NFKC.into(),
        NFD.into(),
        StripAccents.into(),
        Lowercase.into(),
        regex(r"[ \t\r\n]+", " ").into(),
        regex(r"^ $", SENTINEL).into(),
        Strip::new(true, true).into(),
        Replace::new(SENTINEL, " ").expect("a plain pattern").into(),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn normalize(text: &str) -> String {
        let mut n = NormalizedString::from(text);
        key_normalizer().normalize(&mut n).unwrap();
        n.get().to_string()
    }

    /// The steps docs/SPEC.md §11 states, as the library runs them.
    #[test]
    fn normaliser_steps() {
        assert_eq!(normalize(" The"), "the");
        assert_eq!(normalize("Café"), "cafe");
        assert_eq!(normalize(" "), " ");
        assert_eq!(normalize("  \t\n"), " ");
        assert_eq!(normalize("a \t b "), "a b");
        // Every mark goes, not only Mn (U+093E is Mc).
        assert_eq!(normalize("\u{915}\u{93E}"), "\u{915}");
        // Char by char: no final sigma.
        assert_eq!(normalize("ΑΣ"), "ασ");
        // NFKC: the fi ligature and full-width letters.
        assert_eq!(normalize("\u{FB01}Ｘ"), "fix");
        // U+001C is not White_Space: it stays.
        assert_eq!(normalize("\u{1C}a"), "\u{1C}a");
        assert_eq!(normalize("\u{A0}a\u{3000}"), "a");
    }

    #[test]
    fn malformed_files_name_the_file() {
        let err = |text: &str| {
            token_map_from_tokenizer_str(text, "t.json")
                .unwrap_err()
                .to_string()
        };
        for text in [
            "[",
            "{}",
            r#"{"model":{"type":"BPE","vocab":{"a":-1},"merges":[]}}"#,
            r#"{"model":{"type":"WordLevel","vocab":{"a":0},"unk_token":"a"},"decoder":{"type":"Nope"}}"#,
            // A syntax error inside the decoder: the library's reader
            // panics on it when it reads the text itself.
            r#"{"model":{"type":"WordLevel","vocab":{"a":0},"unk_token":"a"},"decoder":{"type":"Metaspace","replacement":"_", da"d":false}}"#,
            // Two tokens with one id: the library decodes it to either.
            r#"{"model":{"type":"WordLevel","vocab":{"a":0,"b":0},"unk_token":"a"}}"#,
            // A charsmap the library `expect`s to read.
            r#"{"model":{"type":"WordLevel","vocab":{"a":0},"unk_token":"a"},"normalizer":{"type":"Precompiled","precompiled_charsmap":"!!"}}"#,
        ] {
            let e = err(text);
            assert!(e.starts_with("tokenizer t.json: "), "{text}: {e}");
            if text.contains("Precompiled") {
                assert!(e.contains("library cannot read it: Precompiled"), "{e}");
            }
        }
    }

    #[test]
    fn first_seen_order_and_fffd_keys() {
        let text = r#"{"model":{"type":"BPE","vocab":{"A":0,"a":1,"Ġa":2,"Ã":3,"Ġ":4,"ĠĠ":5,"b":6},
            "merges":[]},
            "added_tokens":[{"id":7,"content":"<eos>","single_word":false,"lstrip":false,
                "rstrip":false,"normalized":false,"special":true}],
            "decoder":{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,
                "use_regex":true}}"#;
        let c = token_map_from_tokenizer_str(text, "t").unwrap();
        // A, a, " a" share "a"; "Ã" is a lone 0xC3 byte: its raw string;
        // " " is its own key, "  " normalises to " " as well.
        assert_eq!(&*c.map, &[0, 0, 0, 1, 2, 2, 3, 4]);
        assert_eq!(c.keys, vec!["a", "Ã", " ", "b", "<eos>"]);
        assert_eq!(c.compressed_vocab_size(), 5);
    }
}
