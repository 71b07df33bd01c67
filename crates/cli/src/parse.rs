//! Parsers of user input shared by the `metrale-ple` subcommands, kept in a
//! library so the fuzz targets and tests can reach them.
//!
//! Invariant: every parser returns an error naming the flag or file, the
//! line or position and the offending item; none panics on any input.

use std::path::Path;

use anyhow::{Context as _, Result, anyhow, bail};

/// Parse a comma-separated list of token ids; errors name the flag, the
/// item and its 0-based position.
pub fn parse_tokens(flag: &str, text: &str) -> Result<Vec<u32>> {
    if text.trim().is_empty() {
        bail!("--{flag}: no tokens given");
    }
    text.split(',')
        .enumerate()
        .map(|(i, item)| {
            let item = item.trim();
            if item.is_empty() {
                bail!("--{flag}: item at position {i} is empty");
            }
            item.parse::<u32>().map_err(|_| {
                anyhow!("--{flag}: item {item:?} at position {i} is not a token id (an integer in 0..=4294967295)")
            })
        })
        .collect()
}

/// Refuse a token not below `vocab_size`, naming the flag and position.
pub fn check_vocab(flag: &str, tokens: &[u32], vocab_size: u64) -> Result<()> {
    if let Some((i, t)) = tokens
        .iter()
        .enumerate()
        .find(|&(_, &t)| u64::from(t) >= vocab_size)
    {
        bail!("--{flag}: token {t} at position {i} is not below vocab_size {vocab_size}");
    }
    Ok(())
}

/// Parse `--prompts`: JSON lines, each an array of token ids below `vocab`.
pub fn parse_prompts(path: &Path, text: &str, vocab: u64) -> Result<Vec<Vec<u32>>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let at = || format!("{} line {}", path.display(), i + 1);
        let ids: Vec<u64> = serde_json::from_str(line)
            .with_context(|| format!("{}: expected a JSON array of token ids", at()))?;
        if ids.is_empty() {
            bail!("{}: the prompt is empty", at());
        }
        // Ids are u32 whatever the vocabulary claims.
        let limit = vocab.min(u64::from(u32::MAX) + 1);
        if let Some((k, &t)) = ids.iter().enumerate().find(|&(_, &t)| t >= limit) {
            bail!(
                "{}: token {t} at index {k} is not below the vocabulary size {limit}",
                at()
            );
        }
        out.push(ids.into_iter().map(|t| t as u32).collect());
    }
    if out.is_empty() {
        bail!("{}: no prompts", path.display());
    }
    Ok(out)
}

/// Parse `--text`: each non-empty line's bytes are its tokens.
pub fn parse_text(path: &Path, data: &[u8], vocab: u64) -> Result<Vec<Vec<u32>>> {
    if vocab < 256 {
        bail!("--text needs a vocabulary of at least 256 tokens (bytes); this one has {vocab}");
    }
    let out: Vec<Vec<u32>> = data
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| l.iter().map(|&b| b as u32).collect())
        .collect();
    if out.is_empty() {
        bail!("{}: no non-empty line", path.display());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_lists() {
        assert_eq!(parse_tokens("tokens", "1, 2,3").unwrap(), vec![1, 2, 3]);
        let e = parse_tokens("tokens", "1,x,3").unwrap_err().to_string();
        assert!(e.contains("\"x\" at position 1"), "{e}");
        let e = parse_tokens("tokens", "1,,3").unwrap_err().to_string();
        assert!(e.contains("position 1 is empty"), "{e}");
        let e = parse_tokens("history", "-1").unwrap_err().to_string();
        assert!(
            e.contains("--history") && e.contains("\"-1\" at position 0"),
            "{e}"
        );
        let e = parse_tokens("tokens", "4294967296")
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a token id"), "{e}");
        assert!(
            parse_tokens("tokens", " ")
                .unwrap_err()
                .to_string()
                .contains("no tokens")
        );
    }

    #[test]
    fn prompt_lines_are_checked() {
        let p = Path::new("p.jsonl");
        assert_eq!(
            parse_prompts(p, "[1,2]\n\n[3]\n", 10).unwrap(),
            vec![vec![1, 2], vec![3]]
        );
        let e = parse_prompts(p, "[1,2]\n[1,99]\n", 10).unwrap_err();
        assert!(format!("{e:#}").contains("p.jsonl line 2: token 99 at index 1"));
        let e = parse_prompts(p, "[1,\n", 10).unwrap_err();
        assert!(format!("{e:#}").contains("p.jsonl line 1: expected a JSON array"));
        let e = parse_prompts(p, "[]\n", 10).unwrap_err();
        assert!(format!("{e:#}").contains("line 1: the prompt is empty"));
        assert!(parse_prompts(p, "\n", 10).is_err());
    }

    #[test]
    fn text_lines_are_byte_tokens() {
        let p = Path::new("t.txt");
        assert_eq!(
            parse_text(p, b"ab\n\nc", 300).unwrap(),
            vec![vec![97, 98], vec![99]]
        );
        assert!(parse_text(p, b"ab", 100).is_err());
    }
}
