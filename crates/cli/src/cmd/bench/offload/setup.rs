//! The checkpoints `bench offload` serves: the synthetic flagship one,
//! written or opened, and its copies relaid by `table pack` (hot rows
//! packed, rows padded), each made by a child process so its report stays
//! off this command's output.

use super::*;

/// The checkpoint in `dir`: opened when it holds one, else the synthetic
/// flagship checkpoint of `sizes` written there first.
pub(super) fn checkpoint(dir: &Path, sizes: &Sizes) -> Result<Checkpoint, CmdError> {
    let empty = match std::fs::read_dir(dir) {
        Ok(mut entries) => entries.next().is_none(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
        Err(e) => {
            return Err(input(
                anyhow::Error::new(e).context(format!("--checkpoint {}", dir.display())),
            ));
        }
    };
    if empty {
        let t0 = Instant::now();
        let opts = InitOptions {
            preset: Preset::Flagship,
            table_rows: Some(sizes.table_rows),
            dtype: TableDType::Bf16,
            seed: 1,
        };
        eprintln!(
            "bench offload: writing a flagship checkpoint with {} table rows to {}",
            sizes.table_rows,
            dir.display()
        );
        write_synthetic(dir, &opts, &mut |_, _| {})
            .with_context(|| format!("writing the checkpoint to {}", dir.display()))
            .map_err(failure)?;
        eprintln!(
            "bench offload: written in {:.1} s",
            t0.elapsed().as_secs_f64()
        );
    }
    let ck = Checkpoint::open(dir)
        .with_context(|| format!("opening the checkpoint in {}", dir.display()))
        .map_err(input)?;
    Ok(ck)
}

/// Seed of the token stream the hot rows are counted from (the measured
/// stream uses another).
pub(super) const TRACE_SEED: u64 = 0x7ACE_0FF1;

/// `ck` relaid by `table pack --hot-corpus` into `dst` (run as a child
/// process, so its report stays off this command's output), the hot rows
/// counted from the decode workload of `sizes` drawn from [`TRACE_SEED`]
/// (a corpus's second quarter): every sequence's prompt and as many decode
/// tokens as a run takes at most, which `table pack` hashes with every
/// site's hash. Also returns whether the count read its documents more than
/// once.
pub(super) fn pack_hot(
    ck: &Checkpoint,
    source: &Source,
    sizes: &Sizes,
    dst: &Path,
) -> Result<(Checkpoint, bool), CmdError> {
    let t0 = Instant::now();
    let steps = sizes.max_windows * sizes.window + sizes.reps * sizes.measure;
    let mut streams = Streams::new(source, TRACE_SEED, sizes.sequences, source.docs(0.25, 0.5));
    let mut seqs: Vec<Vec<u32>> = (0..sizes.sequences)
        .map(|i| (0..sizes.prompt).map(|_| streams.next(i)).collect())
        .collect();
    for _ in 0..steps {
        for (i, s) in seqs.iter_mut().enumerate() {
            s.push(streams.next(i));
        }
    }
    // The workload's own token stream, as a corpus `table pack` hashes
    // with every site's hash.
    let mut corpus = String::new();
    for s in &seqs {
        corpus.push_str(
            &serde_json::to_string(s)
                .context("encoding the corpus")
                .map_err(failure)?,
        );
        corpus.push('\n');
    }
    let corpus_path = dst.with_extension("corpus.jsonl");
    std::fs::write(&corpus_path, &corpus)
        .with_context(|| format!("writing {}", corpus_path.display()))
        .map_err(failure)?;
    eprintln!(
        "bench offload: relaying the table's hot rows ({} sequences of {} tokens) into {}",
        seqs.len(),
        seqs.first().map_or(0, Vec::len),
        dst.display()
    );
    let packed = run_pack(ck, dst, &["--hot-corpus".as_ref(), corpus_path.as_os_str()]);
    let _ = std::fs::remove_file(&corpus_path);
    let packed = packed?;
    eprintln!(
        "bench offload: packed in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    Ok((packed, streams.reread()))
}

/// `ck` with its table rows padded by `table pack --pad-rows` into `dst`.
pub(super) fn pack_padded(ck: &Checkpoint, dst: &Path) -> Result<Checkpoint, CmdError> {
    let t0 = Instant::now();
    eprintln!(
        "bench offload: padding the table's rows into {}",
        dst.display()
    );
    let padded = run_pack(ck, dst, &["--pad-rows".as_ref()])?;
    eprintln!(
        "bench offload: padded in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    Ok(padded)
}

/// Run `table pack FLAGS ck dst` as a child process (its report stays off
/// this command's output) and open what it wrote.
pub(super) fn run_pack(
    ck: &Checkpoint,
    dst: &Path,
    flags: &[&std::ffi::OsStr],
) -> Result<Checkpoint, CmdError> {
    let exe = std::env::current_exe()
        .context("locating this program to run `table pack`")
        .map_err(failure)?;
    let out = std::process::Command::new(exe)
        .arg("table")
        .arg("pack")
        .args(flags)
        .arg(&ck.dir)
        .arg(dst)
        .stdin(std::process::Stdio::null())
        .output()
        .context("running `table pack`")
        .map_err(failure)?;
    if !out.status.success() {
        return Err(failure(anyhow::anyhow!(
            "`table pack {}` failed: {}",
            flags
                .iter()
                .map(|f| f.to_string_lossy())
                .collect::<Vec<_>>()
                .join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Checkpoint::open(dst)
        .with_context(|| format!("opening the packed checkpoint in {}", dst.display()))
        .map_err(failure)
}
