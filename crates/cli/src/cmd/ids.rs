//! `metrale-ple ids`: derive a PLE site's hash constants (from geometry
//! flags or a config.json of any supported family: Qwen4Exp, Engram,
//! LongCat) and hash a list of tokens after a history.
//!
//! Prints one JSON object: `family`, `multipliers` (empty for LongCat),
//! `head_vocab_sizes` (per head, or per sub-table for LongCat),
//! `head_offsets`, `padded_rows`, `ids` (one row of `ngram_heads` ids per
//! token) and `history` (the history after the tokens). Without
//! `--history` the sequence starts fresh (`context_len` fill tokens: EOS,
//! or Engram's pad id). Every token must be below the family's vocabulary
//! (Engram: the token map's length, or the compressed vocabulary without
//! one); the history must hold exactly `context_len` tokens.
//!
//! Engram's compressed-token map comes from a JSON array (`--token-map`)
//! or is built from the tokenizer (`--tokenizer tokenizer.json`).
//! `--doc-starts` and `--masked` (Engram only) give DeepSeek-V4.1's
//! look-back boundaries as positions in `--tokens` (docs/SPEC.md §11).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context as _, anyhow};
use clap::Args;
use metrale_model_layers::layers::ple::ModelSpec;
use metrale_model_layers::layers::ple::family::engram::load_token_map;
use metrale_model_layers::layers::ple::family::engram::token_map_from_tokenizer_json;
use metrale_model_layers::layers::ple::ids::{
    Boundaries, DEFAULT_DIVISIBLE_BY, DEFAULT_HASH_SEED, DerivedPleIds, HashFamily, IdError,
    PleHashParams, PleIdHasher,
};
use serde_json::json;

use metrale_ple_cli::parse::{check_vocab, parse_tokens};

use super::{CmdError, failure, input};

/// Flags of `metrale-ple ids`.
#[derive(Args, Debug)]
#[command(
    after_help = "Examples:\n  metrale-ple ids --vocab-size 151936 --eos 151645 --ngram-size 3 --heads-per-ngram 8 \\\n      --vocab-base 20000000 --tokens 1,2,3\n  metrale-ple ids --config ckpt/config.json --site 0 --tokens 5,6 --history 7,8\n  metrale-ple ids --config v41/config.json --layer 14 --token-map map.json --tokens 5,6\n  metrale-ple ids --config v41/config.json --layer 14 --tokenizer tokenizer.json \\\n      --tokens 5,6,7,8,9,10 --doc-starts 0,4 --masked 2,3"
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
    #[arg(long, value_name = "I", default_value_t = 0, conflicts_with = "layer")]
    site: usize,
    /// The site on this 0-based model layer (Engram's absolute block
    /// index; with --config only).
    #[arg(long, value_name = "L", requires = "config")]
    layer: Option<usize>,
    /// Engram's compressed-token map: a JSON array, entry t the id hashed
    /// for raw token t (with --config only).
    #[arg(long, value_name = "PATH", requires = "config")]
    token_map: Option<PathBuf>,
    /// Build Engram's compressed-token map from this Hugging Face
    /// tokenizer.json, as the Engram demo does (with --config only).
    #[arg(
        long,
        value_name = "PATH",
        requires = "config",
        conflicts_with = "token_map"
    )]
    tokenizer: Option<PathBuf>,
    /// Engram: positions in --tokens that start a document; the n-gram
    /// look-back does not reach before them, e.g. 0,5.
    #[arg(long, value_name = "LIST", requires = "config")]
    doc_starts: Option<String>,
    /// Engram: positions in --tokens that are masked (e.g. image tokens):
    /// they hash as pad ids and block the look-back, e.g. 3,4.
    #[arg(long, value_name = "LIST", requires = "config")]
    masked: Option<String>,
    /// Comma-separated token ids to hash, e.g. 1,2,3.
    #[arg(long, value_name = "LIST", allow_hyphen_values = true)]
    tokens: String,
    /// Comma-separated history before the tokens (context_len ids)
    /// [default: context_len EOS tokens].
    #[arg(long, value_name = "LIST", allow_hyphen_values = true)]
    history: Option<String>,
}

/// What to hash with: the family, its derived constants and the
/// vocabulary the tokens are checked against.
struct Site {
    family: HashFamily,
    derived: DerivedPleIds,
    /// Qwen4Exp's `vocab_size`; `None` for the families whose hasher
    /// refuses out-of-vocabulary ids itself, naming the position.
    qwen_vocab: Option<u64>,
}

fn from_config(args: &IdsArgs, path: &std::path::Path) -> anyhow::Result<Site> {
    let mut spec = ModelSpec::from_file(path)?;
    if let Some(map_path) = &args.token_map {
        let map = load_token_map(map_path)?;
        spec = spec.with_token_map(map, &map_path.display().to_string())?;
    }
    if let Some(tok_path) = &args.tokenizer {
        let built = token_map_from_tokenizer_json(tok_path)?;
        spec = spec.with_token_map(built.map, &tok_path.display().to_string())?;
    }
    let site = match args.layer {
        None => args.site,
        Some(l) => (0..spec.sites())
            .find(|&s| spec.site_layer(s) == l)
            .ok_or_else(|| {
                let layers: Vec<usize> = (0..spec.sites()).map(|s| spec.site_layer(s)).collect();
                anyhow!(
                    "--layer {l}: {} has no site on that layer (its 0-based layers: {layers:?})",
                    path.display()
                )
            })?,
    };
    let derived = spec
        .derive(site)
        .with_context(|| format!("{}", path.display()))?;
    let family = spec.hash_family();
    // A rule that bounds no token leaves the config's vocabulary to check.
    let qwen_vocab = family.token_limit().is_none().then_some(spec.vocab_size);
    Ok(Site {
        family,
        derived,
        qwen_vocab,
    })
}

fn from_flags(args: &IdsArgs) -> anyhow::Result<Site> {
    // clap enforces these when --config is absent.
    let need = |v: Option<u64>, flag: &str| v.ok_or_else(|| anyhow!("--{flag} is required"));
    let params = PleHashParams {
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
    };
    Ok(Site {
        family: HashFamily::Qwen4Exp,
        derived: params.derive()?,
        qwen_vocab: Some(params.vocab_size),
    })
}

/// Refuse tokens the family does not hash: Qwen4Exp ids at or above
/// `vocab_size`; the other families' limit is checked by the hasher.
fn check_input(flag: &str, tokens: &[u32], vocab: Option<u64>) -> anyhow::Result<()> {
    match vocab {
        Some(v) => check_vocab(flag, tokens, v),
        None => Ok(()),
    }
}

/// One flag per position of `history ++ tokens` from a list of positions
/// in the tokens (`None`: no flags).
fn position_flags(
    flag: &str,
    list: Option<&str>,
    history: usize,
    tokens: usize,
) -> anyhow::Result<Vec<bool>> {
    let Some(text) = list else {
        return Ok(Vec::new());
    };
    let positions = parse_tokens(flag, text)?;
    Boundaries::flags_at(positions.iter().map(|&p| p as usize), history, tokens)
        .map_err(|p| anyhow!("--{flag}: position {p} is past the {tokens} tokens given"))
}

/// Run `metrale-ple ids`.
pub fn run(args: &IdsArgs) -> Result<(), CmdError> {
    let site = match &args.config {
        Some(path) => from_config(args, path),
        None => from_flags(args),
    }
    .map_err(input)?;
    let tokens = parse_tokens("tokens", &args.tokens).map_err(input)?;
    let qwen_vocab = site.qwen_vocab;
    check_input("tokens", &tokens, qwen_vocab).map_err(input)?;
    let derived = &site.derived;
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
            check_input("history", &h, qwen_vocab).map_err(input)?;
            h
        }
    };

    let bounded = args.doc_starts.is_some() || args.masked.is_some();
    if bounded && !site.family.takes_boundaries() {
        return Err(input(anyhow!(
            "--doc-starts and --masked are defined for the Engram family; this config is {}",
            site.family.name()
        )));
    }
    let doc_start = position_flags("doc-starts", args.doc_starts.as_deref(), ctx, tokens.len())
        .map_err(input)?;
    let masked =
        position_flags("masked", args.masked.as_deref(), ctx, tokens.len()).map_err(input)?;

    let hasher = PleIdHasher::with_family(&site.family, dims).map_err(failure)?;
    let heads = dims.ngram_heads();
    let mut ids = vec![0u64; tokens.len() * heads];
    let hashed = if bounded {
        let bounds = Boundaries {
            doc_start: &doc_start,
            masked: &masked,
        };
        hasher.engram_ids_bounded_into(&history, &tokens, bounds, &mut ids)
    } else {
        hasher.ids_with_history_into(&history, &tokens, &mut ids)
    };
    hashed.map_err(|e| match e {
        IdError::TokenOutOfRange { .. } => input(e),
        e => failure(e),
    })?;
    dims.advance_history(&mut history, &tokens);

    let rows: Vec<&[u64]> = ids.chunks_exact(heads).collect();
    let out = json!({
        "family": site.family.name(),
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
