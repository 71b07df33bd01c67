//! Fuzz the command line's input parsers: the `--tokens` / `--history`
//! lists, `--prompts` JSON lines and `--text` files.
//!
//! None may panic. The first byte picks the parser and the vocabulary size;
//! whatever is accepted must hold only ids below the vocabulary, and an
//! accepted token list must parse back to itself once printed.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use metrale_ple_cli::parse::{check_vocab, parse_prompts, parse_text, parse_tokens};

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else { return };
    let vocab: u64 = match sel >> 2 {
        0 => 1,
        1 => 256,
        2 => 4096,
        3 => 151_936,
        4 => u64::from(u32::MAX) + 1,
        5 => u64::MAX,
        n => u64::from(n) * 977,
    };
    match sel & 3 {
        0 => {
            let text = String::from_utf8_lossy(rest);
            if let Ok(t) = parse_tokens("tokens", &text) {
                assert!(!t.is_empty());
                let printed: Vec<String> = t.iter().map(u32::to_string).collect();
                assert_eq!(parse_tokens("tokens", &printed.join(",")).unwrap(), t);
                if check_vocab("tokens", &t, vocab).is_ok() {
                    assert!(t.iter().all(|&x| u64::from(x) < vocab));
                }
            }
        }
        1 | 2 => {
            let Ok(text) = std::str::from_utf8(rest) else { return };
            if let Ok(p) = parse_prompts(Path::new("fuzz.jsonl"), text, vocab) {
                assert!(!p.is_empty());
                assert!(p.iter().all(|x| !x.is_empty()));
                assert!(p.iter().flatten().all(|&x| u64::from(x) < vocab));
            }
        }
        _ => {
            if let Ok(p) = parse_text(Path::new("fuzz.txt"), rest, vocab) {
                assert!(vocab >= 256 && !p.is_empty());
                assert!(p.iter().all(|x| !x.is_empty() && !x.contains(&10)));
            }
        }
    }
});
