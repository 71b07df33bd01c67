//! Engram's compressed-token map built from a Hugging Face `tokenizer.json`
//! (docs/SPEC.md §11, "Token map"), as the Engram demo's
//! `CompressedTokenizer` builds it.
//!
//! For each raw id `0..len` (`len` the number of distinct token strings of
//! the model's vocabulary and the added tokens, what `len(tokenizer)`
//! gives): decode the id alone with the file's decoder; when the text holds
//! U+FFFD the key is the raw token string, otherwise the normalised text,
//! or the text itself when that is empty. Compressed ids are handed out in
//! the order keys are first seen.
//!
//! The normaliser is the demo's `tokenizers` sequence, step by step as that
//! library runs it: NFKC, NFD, drop every combining mark (General_Category
//! M: Mn, Mc and Me, as its `StripAccents` does), lowercase char by char
//! (no final-sigma rule), `[ \t\r\n]+` to one space, a text that is exactly
//! one space to U+E000, trim Unicode White_Space at both ends, U+E000 back
//! to a space.
//!
//! Decoding one token needs the file's decoder. Supported: none (the token
//! itself), `ByteLevel`, `Metaspace`, `Replace` with a plain string,
//! `ByteFallback`, `Fuse`, `Strip` and `Sequence` of these, each as the
//! `tokenizers` library defines it. Any other decoder is refused with
//! [`TokenizerJsonError::Unsupported`] rather than guessed at.
//!
//! Invariants: a malformed file is refused with an error naming the file
//! and the field, never a panic; the map has one entry per raw id and its
//! entries are exactly `0..V'` (every compressed id is used).

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};
use thiserror::Error;
use unicode_normalization::UnicodeNormalization;
use unicode_normalization::char::is_combining_mark;

use super::super::TokenMap;

pub mod library;

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
    /// The text is not JSON.
    #[error("tokenizer {file}: not valid JSON: {msg}")]
    Json {
        /// The file (or text source).
        file: String,
        /// The parser's message.
        msg: String,
    },
    /// A field is missing, of the wrong type or inconsistent.
    #[error("tokenizer {file}: `{field}` {problem}")]
    Field {
        /// The file (or text source).
        file: String,
        /// The field, e.g. `model.vocab` or `added_tokens[3].id`.
        field: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A well-formed decoder or model this reader does not implement.
    #[error("tokenizer {file}: `{field}` is {what}, which is not supported")]
    Unsupported {
        /// The file (or text source).
        file: String,
        /// The field, e.g. `decoder.decoders[1].type`.
        field: String,
        /// What was found.
        what: String,
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
    let root: Value = serde_json::from_str(text).map_err(|e| TokenizerJsonError::Json {
        file: source.to_string(),
        msg: e.to_string(),
    })?;
    let tok = Tokenizer::parse(&root, source)?;
    Ok(tok.compress())
}

/// The demo's normaliser applied to `text` (see the module doc).
pub fn normalize_key(text: &str) -> String {
    let decomposed: String = text.nfkc().nfd().collect();
    let mut lowered = String::with_capacity(decomposed.len());
    for c in decomposed.chars().filter(|&c| !is_combining_mark(c)) {
        lowered.extend(c.to_lowercase());
    }
    let mut collapsed = String::with_capacity(lowered.len());
    let mut in_run = false;
    for c in lowered.chars() {
        if matches!(c, ' ' | '\t' | '\r' | '\n') {
            if !in_run {
                collapsed.push(' ');
            }
            in_run = true;
        } else {
            collapsed.push(c);
            in_run = false;
        }
    }
    // A token that is one space must survive the strip: it is its own key.
    if collapsed == " " {
        return " ".to_string();
    }
    collapsed.trim().replace(SENTINEL, " ")
}

/// The demo's private-use stand-in for a lone space.
const SENTINEL: char = '\u{E000}';

/// The key of a decoded token: its raw string when decoding gave U+FFFD,
/// else the normalised text, or the text when that is empty.
pub fn token_key(decoded: &str, raw: &str) -> String {
    if decoded.contains('\u{FFFD}') {
        return raw.to_string();
    }
    let n = normalize_key(decoded);
    if n.is_empty() { decoded.to_string() } else { n }
}

/// One step of a `tokenizers` decoder.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Decoder {
    ByteLevel,
    Metaspace {
        replacement: char,
        prepend: bool,
    },
    Replace {
        pattern: String,
        content: String,
    },
    ByteFallback,
    Fuse,
    Strip {
        content: char,
        start: usize,
        stop: usize,
    },
    Sequence(Vec<Decoder>),
}

/// What the reader needs of a tokenizer: id to token string, the number
/// of ids and the decoder.
struct Tokenizer {
    /// Added tokens by id; they take precedence over the model's.
    added: HashMap<u32, String>,
    /// The model's tokens by id.
    model: HashMap<u32, String>,
    /// `len(tokenizer)`: distinct strings over the model and added tokens.
    len: usize,
    decoder: Option<Decoder>,
}

struct Ctx<'a> {
    file: &'a str,
}

impl Ctx<'_> {
    fn field(&self, field: &str, problem: impl Into<String>) -> TokenizerJsonError {
        TokenizerJsonError::Field {
            file: self.file.to_string(),
            field: field.to_string(),
            problem: problem.into(),
        }
    }

    fn unsupported(&self, field: &str, what: impl Into<String>) -> TokenizerJsonError {
        TokenizerJsonError::Unsupported {
            file: self.file.to_string(),
            field: field.to_string(),
            what: what.into(),
        }
    }

    fn object<'v>(
        &self,
        v: &'v Value,
        field: &str,
    ) -> Result<&'v Map<String, Value>, TokenizerJsonError> {
        v.as_object()
            .ok_or_else(|| self.field(field, format!("must be an object, got {}", kind(v))))
    }

    fn string<'v>(&self, v: Option<&'v Value>, field: &str) -> Result<&'v str, TokenizerJsonError> {
        match v {
            Some(Value::String(s)) => Ok(s),
            Some(v) => Err(self.field(field, format!("must be a string, got {}", kind(v)))),
            None => Err(self.field(field, "is missing")),
        }
    }

    fn id(&self, v: &Value, field: &str) -> Result<u32, TokenizerJsonError> {
        v.as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(|| {
                self.field(
                    field,
                    format!("must be a token id in 0..=4294967295, got {v}"),
                )
            })
    }

    fn one_char(&self, v: Option<&Value>, field: &str) -> Result<char, TokenizerJsonError> {
        let s = self.string(v, field)?;
        let mut it = s.chars();
        match (it.next(), it.next()) {
            (Some(c), None) => Ok(c),
            _ => Err(self.field(field, format!("must be exactly one character, got {s:?}"))),
        }
    }

    fn count(&self, v: Option<&Value>, field: &str) -> Result<usize, TokenizerJsonError> {
        match v {
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .ok_or_else(|| {
                    self.field(field, format!("must be a non-negative integer, got {v}"))
                }),
            None => Err(self.field(field, "is missing")),
        }
    }
}

/// The JSON type of `v`, for messages.
fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Decoders nest; deeper than this is refused rather than recursed into.
const MAX_DECODER_DEPTH: usize = 16;

impl Tokenizer {
    fn parse(root: &Value, file: &str) -> Result<Self, TokenizerJsonError> {
        let cx = Ctx { file };
        let root = cx.object(root, "(top level)")?;
        let model_v = root
            .get("model")
            .ok_or_else(|| cx.field("model", "is missing"))?;
        let model_o = cx.object(model_v, "model")?;
        let mut model = HashMap::new();
        let mut strings: HashSet<&str> = HashSet::new();
        match model_o.get("vocab") {
            // BPE, WordPiece, WordLevel: token -> id.
            Some(Value::Object(vocab)) => {
                for (tok, id) in vocab {
                    let field = format!("model.vocab[{tok:?}]");
                    let id = cx.id(id, &field)?;
                    if let Some(prev) = model.insert(id, tok.clone()) {
                        return Err(
                            cx.field(&field, format!("gives id {id}, which {prev:?} already has"))
                        );
                    }
                    strings.insert(tok.as_str());
                }
            }
            // Unigram: [[piece, score], ...], the id being the index.
            Some(Value::Array(pieces)) => {
                for (i, p) in pieces.iter().enumerate() {
                    let field = format!("model.vocab[{i}]");
                    let piece = match p.as_array().map(Vec::as_slice) {
                        Some([Value::String(s), score]) if score.is_number() => s,
                        _ => {
                            return Err(cx.field(&field, "must be a [piece, score] pair"));
                        }
                    };
                    let id = u32::try_from(i)
                        .map_err(|_| cx.field("model.vocab", "has more than 2^32 entries"))?;
                    model.insert(id, piece.clone());
                    strings.insert(piece.as_str());
                }
            }
            Some(v) => {
                return Err(cx.field(
                    "model.vocab",
                    format!("must be an object or an array, got {}", kind(v)),
                ));
            }
            None => return Err(cx.field("model.vocab", "is missing")),
        }
        let mut added = HashMap::new();
        match root.get("added_tokens") {
            None | Some(Value::Null) => {}
            Some(Value::Array(items)) => {
                for (i, item) in items.iter().enumerate() {
                    let field = format!("added_tokens[{i}]");
                    let o = cx.object(item, &field)?;
                    let id = match o.get("id") {
                        Some(v) => cx.id(v, &format!("{field}.id"))?,
                        None => return Err(cx.field(&format!("{field}.id"), "is missing")),
                    };
                    let content = cx.string(o.get("content"), &format!("{field}.content"))?;
                    added.insert(id, content.to_string());
                    strings.insert(content);
                }
            }
            Some(v) => {
                return Err(cx.field("added_tokens", format!("must be an array, got {}", kind(v))));
            }
        }
        let len = strings.len();
        let decoder = match root.get("decoder") {
            None | Some(Value::Null) => None,
            Some(d) => Some(parse_decoder(&cx, d, "decoder", 0)?),
        };
        Ok(Self {
            added,
            model,
            len,
            decoder,
        })
    }

    /// The token string of `id` (added tokens first), if any.
    fn token(&self, id: u32) -> Option<&str> {
        self.added
            .get(&id)
            .or_else(|| self.model.get(&id))
            .map(String::as_str)
    }

    /// `id` decoded alone; an id with no token decodes to "".
    fn decode_one(&self, id: u32) -> String {
        let Some(tok) = self.token(id) else {
            return String::new();
        };
        match &self.decoder {
            None => tok.to_string(),
            Some(d) => d.decode_chain(vec![tok.to_string()]).concat(),
        }
    }

    fn compress(&self) -> CompressedTokens {
        let mut index: HashMap<String, u32> = HashMap::new();
        let mut keys = Vec::new();
        let mut map = Vec::with_capacity(self.len);
        for id in 0..self.len {
            // len counts distinct strings, each with a u32 id, so it fits.
            let id = id as u32;
            let text = self.decode_one(id);
            let key = token_key(&text, self.token(id).unwrap_or(""));
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
        CompressedTokens {
            map: map.into(),
            keys,
        }
    }
}

fn parse_decoder(
    cx: &Ctx<'_>,
    v: &Value,
    field: &str,
    depth: usize,
) -> Result<Decoder, TokenizerJsonError> {
    if depth >= MAX_DECODER_DEPTH {
        return Err(cx.field(
            field,
            format!("nests decoders deeper than {MAX_DECODER_DEPTH}"),
        ));
    }
    let o = cx.object(v, field)?;
    let ty_field = format!("{field}.type");
    let ty = cx.string(o.get("type"), &ty_field)?;
    let sub = |name: &str| format!("{field}.{name}");
    Ok(match ty {
        "ByteLevel" => Decoder::ByteLevel,
        "Metaspace" => {
            let replacement = cx.one_char(o.get("replacement"), &sub("replacement"))?;
            // Older files state add_prefix_space instead of prepend_scheme.
            let prepend = match (o.get("prepend_scheme"), o.get("add_prefix_space")) {
                (Some(s), _) => match cx.string(Some(s), &sub("prepend_scheme"))? {
                    "always" | "first" => true,
                    "never" => false,
                    other => {
                        return Err(cx.field(
                            &sub("prepend_scheme"),
                            format!("must be \"always\", \"first\" or \"never\", got {other:?}"),
                        ));
                    }
                },
                (None, Some(Value::Bool(b))) => *b,
                (None, Some(v)) => {
                    return Err(cx.field(
                        &sub("add_prefix_space"),
                        format!("must be a boolean, got {}", kind(v)),
                    ));
                }
                (None, None) => true,
            };
            Decoder::Metaspace {
                replacement,
                prepend,
            }
        }
        "Replace" => {
            let pf = sub("pattern");
            let p = o
                .get("pattern")
                .ok_or_else(|| cx.field(&pf, "is missing"))?;
            let p = cx.object(p, &pf)?;
            let pattern = match (p.get("String"), p.get("Regex")) {
                (Some(s), _) => cx.string(Some(s), &format!("{pf}.String"))?.to_string(),
                (None, Some(_)) => return Err(cx.unsupported(&pf, "a regex pattern")),
                (None, None) => {
                    return Err(cx.field(&pf, "must hold `String` or `Regex`"));
                }
            };
            if pattern.is_empty() {
                return Err(cx.field(&format!("{pf}.String"), "is empty"));
            }
            let content = cx.string(o.get("content"), &sub("content"))?.to_string();
            Decoder::Replace { pattern, content }
        }
        "ByteFallback" => Decoder::ByteFallback,
        "Fuse" => Decoder::Fuse,
        "Strip" => Decoder::Strip {
            content: cx.one_char(o.get("content"), &sub("content"))?,
            start: cx.count(o.get("start"), &sub("start"))?,
            stop: cx.count(o.get("stop"), &sub("stop"))?,
        },
        "Sequence" => {
            let df = sub("decoders");
            let items = match o.get("decoders") {
                Some(Value::Array(items)) => items,
                Some(v) => return Err(cx.field(&df, format!("must be an array, got {}", kind(v)))),
                None => return Err(cx.field(&df, "is missing")),
            };
            let mut out = Vec::with_capacity(items.len());
            for (i, d) in items.iter().enumerate() {
                out.push(parse_decoder(cx, d, &format!("{df}[{i}]"), depth + 1)?);
            }
            Decoder::Sequence(out)
        }
        other => return Err(cx.unsupported(&ty_field, format!("the decoder {other:?}"))),
    })
}

/// The byte that GPT-2's byte-to-unicode table maps onto `c`, if any:
/// printable Latin-1 bytes stand for themselves, the other 68 bytes, in
/// order, for U+0100 onwards.
fn byte_of_char(c: char) -> Option<u8> {
    let u = c as u32;
    let printable = |b: u32| {
        (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    if printable(u) {
        return Some(u as u8);
    }
    let n = u.checked_sub(0x100)?;
    (0u32..=0xFF)
        .filter(|&b| !printable(b))
        .nth(n as usize)
        .map(|b| b as u8)
}

/// `<0xHH>` as `tokenizers`' ByteFallback reads it.
fn fallback_byte(tok: &str) -> Option<u8> {
    if tok.len() == 6 && tok.starts_with("<0x") && tok.ends_with('>') {
        // from_str_radix, like the library, accepts a leading '+'.
        u8::from_str_radix(&tok[3..5], 16).ok()
    } else {
        None
    }
}

impl Decoder {
    /// The library's `decode_chain`: tokens in, tokens out.
    fn decode_chain(&self, tokens: Vec<String>) -> Vec<String> {
        match self {
            Decoder::ByteLevel => {
                let mut bytes = Vec::new();
                for t in &tokens {
                    // A token with any char outside the table (an added
                    // token, say) stands for its own UTF-8 bytes.
                    let mapped: Option<Vec<u8>> = t.chars().map(byte_of_char).collect();
                    match mapped {
                        Some(b) => bytes.extend(b),
                        None => bytes.extend_from_slice(t.as_bytes()),
                    }
                }
                vec![String::from_utf8_lossy(&bytes).into_owned()]
            }
            Decoder::Metaspace {
                replacement,
                prepend,
            } => tokens
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    t.chars()
                        .filter_map(|c| {
                            if c != *replacement {
                                Some(c)
                            } else if i == 0 && *prepend {
                                None
                            } else {
                                Some(' ')
                            }
                        })
                        .collect()
                })
                .collect(),
            Decoder::Replace { pattern, content } => tokens
                .iter()
                .map(|t| t.replace(pattern.as_str(), content))
                .collect(),
            Decoder::ByteFallback => {
                let mut out = Vec::with_capacity(tokens.len());
                let mut pending: Vec<u8> = Vec::new();
                let flush = |pending: &mut Vec<u8>, out: &mut Vec<String>| {
                    if pending.is_empty() {
                        return;
                    }
                    match String::from_utf8(std::mem::take(pending)) {
                        Ok(s) => out.push(s),
                        Err(e) => out.push("\u{FFFD}".repeat(e.as_bytes().len())),
                    }
                };
                for t in tokens {
                    match fallback_byte(&t) {
                        Some(b) => pending.push(b),
                        None => {
                            flush(&mut pending, &mut out);
                            out.push(t);
                        }
                    }
                }
                flush(&mut pending, &mut out);
                out
            }
            Decoder::Fuse => vec![tokens.concat()],
            Decoder::Strip {
                content,
                start,
                stop,
            } => tokens
                .iter()
                .map(|t| {
                    let chars: Vec<char> = t.chars().collect();
                    let lead = chars
                        .iter()
                        .take(*start)
                        .take_while(|&&c| c == *content)
                        .count();
                    let trail = chars
                        .iter()
                        .rev()
                        .take(*stop)
                        .take_while(|&&c| c == *content)
                        .count();
                    let end = chars.len() - trail;
                    if end <= lead {
                        String::new()
                    } else {
                        chars[lead..end].iter().collect()
                    }
                })
                .collect(),
            Decoder::Sequence(ds) => ds.iter().fold(tokens, |t, d| d.decode_chain(t)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_gpt2s() {
        assert_eq!(byte_of_char('A'), Some(b'A'));
        assert_eq!(byte_of_char('Ġ'), Some(b' '));
        assert_eq!(byte_of_char('Ċ'), Some(b'\n'));
        assert_eq!(byte_of_char('\u{100}'), Some(0));
        assert_eq!(byte_of_char('é'), Some(0xE9));
        assert_eq!(byte_of_char(' '), None);
        assert_eq!(byte_of_char('日'), None);
        let all: std::collections::HashSet<u8> = (0..0x200u32)
            .filter_map(char::from_u32)
            .filter_map(byte_of_char)
            .collect();
        assert_eq!(all.len(), 256);
    }

    #[test]
    fn normaliser_steps() {
        assert_eq!(normalize_key(" The"), "the");
        assert_eq!(normalize_key("Café"), "cafe");
        assert_eq!(normalize_key(" "), " ");
        assert_eq!(normalize_key("  \t\n"), " ");
        assert_eq!(normalize_key("a \t b "), "a b");
        // Every mark goes, not only Mn (U+093E is Mc).
        assert_eq!(normalize_key("\u{915}\u{93E}"), "\u{915}");
        // Char by char: no final sigma.
        assert_eq!(normalize_key("ΑΣ"), "ασ");
        // NFKC: the fi ligature and full-width letters.
        assert_eq!(normalize_key("\u{FB01}Ｘ"), "fix");
        // U+001C is not White_Space: it stays.
        assert_eq!(normalize_key("\u{1C}a"), "\u{1C}a");
        assert_eq!(normalize_key("\u{A0}a\u{3000}"), "a");
        assert_eq!(token_key("\u{301}", "x"), "\u{301}");
        assert_eq!(token_key("a\u{FFFD}", "raw"), "raw");
    }

    #[test]
    fn decoders_as_the_library() {
        let meta = Decoder::Metaspace {
            replacement: '▁',
            prepend: true,
        };
        assert_eq!(meta.decode_chain(vec!["▁▁a▁b".into()]), vec!["ab"]);
        let never = Decoder::Metaspace {
            replacement: '▁',
            prepend: false,
        };
        assert_eq!(never.decode_chain(vec!["▁▁a▁b".into()]), vec!["  a b"]);
        let llama = Decoder::Sequence(vec![
            Decoder::Replace {
                pattern: "▁".into(),
                content: " ".into(),
            },
            Decoder::ByteFallback,
            Decoder::Fuse,
            Decoder::Strip {
                content: ' ',
                start: 1,
                stop: 0,
            },
        ]);
        let one = |t: &str| llama.decode_chain(vec![t.to_string()]).concat();
        assert_eq!(one("▁▁a"), " a");
        assert_eq!(one("<0x41>"), "A");
        assert_eq!(one("<0xE6>"), "\u{FFFD}");
        assert_eq!(one("<0x4>"), "<0x4>");
        assert_eq!(one("<0x+F>"), "\u{F}");
        assert_eq!(one("  x  "), " x  ");
        let strip = Decoder::Strip {
            content: ' ',
            start: 2,
            stop: 2,
        };
        assert_eq!(strip.decode_chain(vec!["   a   ".into()]), vec![" a "]);
        assert_eq!(strip.decode_chain(vec!["  ".into()]), vec![""]);
        let bl = Decoder::ByteLevel;
        assert_eq!(bl.decode_chain(vec!["Ġx".into()]), vec![" x"]);
        assert_eq!(bl.decode_chain(vec!["bé".into()]), vec!["b\u{FFFD}"]);
        assert_eq!(bl.decode_chain(vec!["<s é>".into()]), vec!["<s é>"]);
    }

    #[test]
    fn malformed_files_name_the_field() {
        let err = |text: &str| {
            token_map_from_tokenizer_str(text, "t.json")
                .unwrap_err()
                .to_string()
        };
        assert!(err("[").contains("not valid JSON"));
        assert!(err("{}").contains("`model`"));
        assert!(err(r#"{"model":{"vocab":{"a":-1}}}"#).contains("model.vocab[\"a\"]"));
        assert!(err(r#"{"model":{"vocab":{"a":0,"b":0}}}"#).contains("already has"));
        assert!(
            err(r#"{"model":{"vocab":{"a":0}},"added_tokens":[{"id":1}]}"#)
                .contains("added_tokens[0].content")
        );
        let e = err(r#"{"model":{"vocab":{"a":0}},"decoder":{"type":"WordPiece"}}"#);
        assert!(
            e.contains("decoder.type") && e.contains("not supported"),
            "{e}"
        );
        let e = err(
            r#"{"model":{"vocab":{"a":0}},"decoder":{"type":"Sequence","decoders":[{"type":"Replace","pattern":{"Regex":"x"},"content":""}]}}"#,
        );
        assert!(e.contains("decoder.decoders[0].pattern"), "{e}");
        let deep = format!(
            r#"{{"model":{{"vocab":{{"a":0}}}},"decoder":{}{{"type":"Fuse"}}{}}}"#,
            r#"{"type":"Sequence","decoders":["#.repeat(40),
            "]}".repeat(40)
        );
        assert!(err(&deep).contains("deeper"));
    }

    #[test]
    fn first_seen_order_and_fffd_keys() {
        let text = r#"{"model":{"type":"BPE","vocab":{"A":0,"a":1,"Ġa":2,"Ã":3,"Ġ":4,"ĠĠ":5,"b":6}},
            "added_tokens":[{"id":7,"content":"<eos>","special":true}],
            "decoder":{"type":"ByteLevel"}}"#;
        let c = token_map_from_tokenizer_str(text, "t").unwrap();
        // A, a, " a" share "a"; "Ã" is a lone 0xC3 byte: its raw string;
        // " " is its own key, "  " normalises to " " as well.
        assert_eq!(&*c.map, &[0, 0, 0, 1, 2, 2, 3, 4]);
        assert_eq!(c.keys, vec!["a", "Ã", " ", "b", "<eos>"]);
        assert_eq!(c.compressed_vocab_size(), 5);
    }
}
