//! `metrale-ple ids`: derive a PLE site's hash constants (from geometry
//! flags or a config.json) and hash a list of tokens after a history.
//!
//! Prints one JSON object: `multipliers`, `head_vocab_sizes`,
//! `head_offsets`, `padded_rows`, `ids` (one row of `ngram_heads` ids per
//! token) and `history` (the history after the tokens). Without
//! `--history` the sequence starts fresh (`context_len` EOS tokens). Every
//! token must be below `vocab_size`; the history must hold exactly
//! `context_len` tokens.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context as _, anyhow};
use clap::Args;
use metrale_model_layers::layers::ple::ModelSpec;
use metrale_model_layers::layers::ple::ids::{
    DEFAULT_DIVISIBLE_BY, DEFAULT_HASH_SEED, PleHashParams, PleIdHasher,
};
use serde_json::json;

use metrale_ple_cli::parse::{check_vocab, parse_tokens};

use super::{CmdError, failure, input};

/// Flags of `metrale-ple ids`.
#[derive(Args, Debug)]
#[command(
    after_help = "Examples:\n  metrale-ple ids --vocab-size 151936 --eos 151645 --ngram-size 3 --heads-per-ngram 8 \\\n      --vocab-base 20000000 --tokens 1,2,3\n  metrale-ple ids --config ckpt/config.json --site 0 --tokens 5,6 --history 7,8"
)]
pub struct IdsArgs {
    /// Take the geometry from this config.json instead of the flags.
    #[arg(
        long,
        value_name = "PATH",
        conflicts_with_all = ["vocab_size", "eos", "ngram_size", "heads_per_ngram", "vocab_base", "divisible_by", "seed"]
    )]
    config: Option<PathBuf>,
    /// Unigram vocabulary size.
    #[arg(long, value_name = "V", required_unless_present = "config")]
    vocab_size: Option<u64>,
    /// EOS token id.
    #[arg(long, value_name = "E", required_unless_present = "config")]
    eos: Option<u32>,
    /// N: the largest n-gram order.
    #[arg(long, value_name = "N", required_unless_present = "config")]
    ngram_size: Option<usize>,
    /// K: heads per order.
    #[arg(long, value_name = "K", required_unless_present = "config")]
    heads_per_ngram: Option<usize>,
    /// Head sizes are the primes at or above this.
    #[arg(long, value_name = "B", required_unless_present = "config")]
    vocab_base: Option<u64>,
    /// Pad the table's rows to a multiple of this [default: 128].
    #[arg(long, value_name = "D")]
    divisible_by: Option<u64>,
    /// Hash seed [default: 1234].
    #[arg(long, value_name = "S")]
    seed: Option<u64>,
    /// PLE site: the position in ple_layer_ids, not the layer number.
    #[arg(long, value_name = "I", default_value_t = 0)]
    site: usize,
    /// Comma-separated token ids to hash, e.g. 1,2,3.
    #[arg(long, value_name = "LIST", allow_hyphen_values = true)]
    tokens: String,
    /// Comma-separated history before the tokens (context_len ids)
    /// [default: context_len EOS tokens].
    #[arg(long, value_name = "LIST", allow_hyphen_values = true)]
    history: Option<String>,
}

fn params(args: &IdsArgs) -> anyhow::Result<PleHashParams> {
    if let Some(path) = &args.config {
        let spec = ModelSpec::from_file(path)?;
        return spec
            .hash_params(args.site)
            .with_context(|| format!("{}", path.display()));
    }
    // clap enforces these when --config is absent.
    let need = |v: Option<u64>, flag: &str| v.ok_or_else(|| anyhow!("--{flag} is required"));
    Ok(PleHashParams {
        vocab_size: need(args.vocab_size, "vocab-size")?,
        eos_token_id: args.eos.ok_or_else(|| anyhow!("--eos is required"))?,
        ngram_size: args
            .ngram_size
            .ok_or_else(|| anyhow!("--ngram-size is required"))?,
        heads_per_ngram: args
            .heads_per_ngram
            .ok_or_else(|| anyhow!("--heads-per-ngram is required"))?,
        ngram_vocab_size_base: need(args.vocab_base, "vocab-base")?,
        divisible_by: args.divisible_by.unwrap_or(DEFAULT_DIVISIBLE_BY),
        seed: args.seed.unwrap_or(DEFAULT_HASH_SEED),
        site: args.site,
    })
}

/// Run `metrale-ple ids`.
pub fn run(args: &IdsArgs) -> Result<(), CmdError> {
    let params = params(args).map_err(input)?;
    let tokens = parse_tokens("tokens", &args.tokens).map_err(input)?;
    check_vocab("tokens", &tokens, params.vocab_size).map_err(input)?;
    let derived = params.derive().map_err(input)?;
    let dims = &derived.dims;
    let ctx = dims.context_len();
    let mut history = match &args.history {
        None => vec![dims.eos_token_id; ctx],
        Some(text) => {
            let h = parse_tokens("history", text).map_err(input)?;
            if h.len() != ctx {
                return Err(input(anyhow!(
                    "--history: {} tokens given, context_len (ngram_size - 1) is {ctx}",
                    h.len()
                )));
            }
            check_vocab("history", &h, params.vocab_size).map_err(input)?;
            h
        }
    };

    let hasher = PleIdHasher::new(dims).map_err(failure)?;
    let heads = dims.ngram_heads();
    let mut ids = vec![0u64; tokens.len() * heads];
    hasher
        .ids_with_history_into(&history, &tokens, &mut ids)
        .map_err(failure)?;
    dims.advance_history(&mut history, &tokens);

    let rows: Vec<&[u64]> = ids.chunks_exact(heads).collect();
    let out = json!({
        "multipliers": dims.multipliers,
        "head_vocab_sizes": dims.head_vocab_sizes,
        "head_offsets": dims.head_offsets,
        "padded_rows": derived.padded_rows,
        "ids": rows,
        "history": history,
    });
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{out}")
        .and_then(|()| stdout.flush())
        .context("cannot write to stdout")
        .map_err(CmdError::Failure)
}
