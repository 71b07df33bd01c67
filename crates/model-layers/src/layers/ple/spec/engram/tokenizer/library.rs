//! The compressed-token map built by the Hugging Face `tokenizers` library
//! itself: its `tokenizer.json` reader, its `decode` and its normalisers.

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use tokenizers::normalizers::replace::ReplacePattern;
use tokenizers::normalizers::{Lowercase, NFD, NFKC, Replace, Sequence, Strip, StripAccents};
use tokenizers::{NormalizedString, Normalizer, Tokenizer};

use super::{CompressedTokens, TokenizerJsonError};

/// The demo's private-use stand-in for a lone space.
const SENTINEL: &str = "\u{E000}";

/// The demo's key normaliser, as it builds it from the library.
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

/// [`super::token_map_from_tokenizer_str`] through the library.
pub fn token_map_from_tokenizer_str(
    text: &str,
    source: &str,
) -> Result<CompressedTokens, TokenizerJsonError> {
    let tok: Tokenizer = serde_json::from_str(text).map_err(|e| TokenizerJsonError::Json {
        file: source.to_string(),
        msg: e.to_string(),
    })?;
    let norm = key_normalizer();
    let len = tok.get_vocab_size(true);
    let mut index: HashMap<String, u32> = HashMap::new();
    let mut keys = Vec::new();
    let mut map = Vec::with_capacity(len);
    for id in 0..len {
        let id = u32::try_from(id).expect("a vocabulary of u32 ids");
        let text = tok
            .decode(&[id], false)
            .map_err(|e| TokenizerJsonError::Json {
                file: source.to_string(),
                msg: format!("decoding id {id}: {e}"),
            })?;
        let key = if text.contains('\u{FFFD}') {
            tok.id_to_token(id).unwrap_or_default()
        } else {
            let mut n = NormalizedString::from(text.as_str());
            norm.normalize(&mut n)
                .map_err(|e| TokenizerJsonError::Json {
                    file: source.to_string(),
                    msg: format!("normalising id {id}: {e}"),
                })?;
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
