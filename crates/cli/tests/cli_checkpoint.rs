//! The binary end to end on checkpoints: `init`, `inspect`, `table pack`,
//! and every refusal of a damaged checkpoint with its exit status and
//! message.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use metrale_storage::safetensors::{Dtype, Header, TensorSpec};
use metrale_testkit::files::{replace_tensor, reshape_tensor};

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_metrale-ple"));
    c.env_remove("RUST_LOG");
    c
}

fn run(args: &[&str]) -> Output {
    bin().args(args).output().expect("the binary runs")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// A tiny checkpoint cut to 4096 rows per site (2 sites, 2 shards each).
fn init(dir: &Path) -> PathBuf {
    let p = dir.join("ck");
    let o = run(&[
        "init",
        p.to_str().unwrap(),
        "--preset",
        "tiny",
        "--table-rows",
        "4096",
        "--seed",
        "3",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "init failed: {out} {err}");
    assert!(out.contains("wrote tiny checkpoint"), "{out}");
    p
}

fn inspect_refusal(ck: &Path) -> String {
    let o = run(&["inspect", ck.to_str().unwrap()]);
    let (out, err) = text(&o);
    assert_eq!(
        o.status.code(),
        Some(2),
        "inspect should refuse: {out} {err}"
    );
    assert!(out.contains("validation          REFUSED"), "{out}");
    err
}

#[test]
fn init_then_inspect_shows_geometry_sizes_and_shards() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = init(tmp.path());
    let o = run(&["inspect", ck.to_str().unwrap()]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out} {err}");
    for want in [
        "highway           hidden 64 x hc 4 = 256 channels",
        "sites             2 at layer ids [2, 3]",
        "site 0 (model.layers.1.ple)",
        "site 1 (model.layers.2.ple)",
        "(ids folded: row = id % 4096)",
        "shards          2 x [2048, 16]",
        "rows per token    8",
        "carry per seq",
        "validation          OK",
    ] {
        assert!(out.contains(want), "missing {want:?} in:\n{out}");
    }
}

#[test]
fn flagship_fp8_is_the_real_geometry_with_a_cut_table() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("f");
    let o = run(&[
        "init",
        p.to_str().unwrap(),
        "--preset",
        "flagship",
        "--table-rows",
        "1000",
        "--dtype",
        "fp8",
    ]);
    assert!(o.status.success(), "{:?}", text(&o));
    let o = run(&["inspect", p.to_str().unwrap()]);
    let (out, _) = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("hidden 2048 x hc 4 = 8192 channels"), "{out}");
    assert!(out.contains("16 heads of 128 values (E = 2048)"), "{out}");
    assert!(
        out.contains("320001536 rows addressed, 1024 stored (ids folded: row = id % 1024)"),
        "{out}"
    );
    assert!(out.contains("FP8 E4M3 + f32 row scales"), "{out}");
    assert!(out.contains("aux blob 294924 B per site"), "{out}");
}

#[test]
fn init_refuses_a_non_empty_directory_and_bad_flags() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = init(tmp.path());
    let o = run(&["init", ck.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o).1.contains("already exists and is not empty"),
        "{:?}",
        text(&o)
    );
    let o = run(&["init", "x", "--preset", "huge"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).1.contains("huge"), "{:?}", text(&o));
    let o = run(&[
        "init",
        tmp.path().join("y").to_str().unwrap(),
        "--table-rows",
        "0",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o).1.contains("--table-rows must be positive"),
        "{:?}",
        text(&o)
    );
}

#[test]
fn every_command_has_help_with_an_example() {
    let mut commands = vec![
        &["init", "--help"][..],
        &["inspect", "--help"],
        &["table", "pack", "--help"],
        &["ids", "--help"],
        &["run", "--help"],
        &["soak", "--help"],
    ];
    if cfg!(feature = "bench") {
        commands.push(&["bench", "--help"]);
    }
    for args in commands {
        let o = run(args);
        let (out, _) = text(&o);
        assert!(o.status.success(), "{args:?}");
        assert!(out.contains("Example"), "{args:?}: {out}");
    }
}

#[test]
fn bench_is_a_command_only_with_the_bench_feature() {
    let o = run(&["bench", "--help"]);
    if cfg!(feature = "bench") {
        assert!(o.status.success(), "{:?}", text(&o));
    } else {
        assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
        assert!(
            text(&o).1.contains("unrecognized subcommand 'bench'"),
            "{:?}",
            text(&o)
        );
    }
}

#[test]
fn a_wrong_shape_is_refused_with_file_and_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = init(tmp.path());
    let f = ck.join("model-00001-of-00005.safetensors");
    reshape_tensor(&f, "model.layers.1.ple.key_proj.weight", &[256, 63]);
    let err = inspect_refusal(&ck);
    assert!(err.contains("model-00001-of-00005.safetensors"), "{err}");
    assert!(
        err.contains(
            "tensor model.layers.1.ple.key_proj.weight has shape [256, 63], expected [256, 64]"
        ),
        "{err}"
    );
}

#[test]
fn an_even_multiplier_is_refused() {
    use std::os::unix::fs::FileExt;
    let tmp = tempfile::tempdir().unwrap();
    let ck = init(tmp.path());
    let f = ck.join("model-00001-of-00005.safetensors");
    let name = "model.layers.2.ple.ple_embedding.layer_multipliers";
    let off = Header::read(&f).unwrap().get(name).unwrap().offset;
    let file = std::fs::OpenOptions::new().write(true).open(&f).unwrap();
    file.write_all_at(&1000i64.to_le_bytes(), off + 8).unwrap();
    let err = inspect_refusal(&ck);
    assert!(err.contains("model-00001-of-00005.safetensors"), "{err}");
    assert!(
        err.contains(&format!(
            "tensor {name}: multiplier 1 is 1000, which is even"
        )),
        "{err}"
    );
}

#[test]
fn a_missing_shard_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = init(tmp.path());
    std::fs::remove_file(ck.join("model-00005-of-00005.safetensors")).unwrap();
    let err = inspect_refusal(&ck);
    assert!(err.contains("model-00005-of-00005.safetensors"), "{err}");
    assert!(
        err.contains("model.layers.2.ple.ple_embedding.ngram_embedding.shard_1.weight"),
        "{err}"
    );
}

#[test]
fn a_corrupt_header_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = init(tmp.path());
    let f = ck.join("model-00002-of-00005.safetensors");
    let mut b = std::fs::read(&f).unwrap();
    b[8] = b'x';
    std::fs::write(&f, b).unwrap();
    let err = inspect_refusal(&ck);
    assert!(
        err.contains("model-00002-of-00005.safetensors: corrupt safetensors header"),
        "{err}"
    );
}

#[test]
fn a_bad_dtype_and_a_bad_config_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = init(tmp.path());
    let f = ck.join("model-00001-of-00005.safetensors");
    let name = "model.layers.1.ple.norm_key.weight";
    let h = Header::read(&f).unwrap();
    let t = h.get(name).unwrap();
    let data = h.read_tensor(name).unwrap();
    replace_tensor(&f, name, TensorSpec::new(name, Dtype::I32, &t.shape), data);
    let err = inspect_refusal(&ck);
    assert!(
        err.contains(
            "tensor model.layers.1.ple.norm_key.weight has dtype I32, expected a float dtype"
        ),
        "{err}"
    );

    let cfg = ck.join("config.json");
    let t = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("\"hc_count\": 4", "\"hc_count\": \"four\"");
    std::fs::write(&cfg, t).unwrap();
    let err = inspect_refusal(&ck);
    assert!(
        err.contains("config.json") && err.contains("hc_count"),
        "{err}"
    );
}

#[test]
fn table_pack_realigns_every_file_and_keeps_the_checkpoint_valid() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = init(tmp.path());
    let dst = tmp.path().join("packed");
    let o = run(&["table", "pack", ck.to_str().unwrap(), dst.to_str().unwrap()]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out} {err}");
    assert!(
        out.contains("packed 5 files") && out.contains("validation OK"),
        "{out}"
    );
    let o = run(&["inspect", dst.to_str().unwrap()]);
    let (out, _) = text(&o);
    assert!(o.status.success());
    assert_eq!(out.matches(" (4 KiB aligned)").count(), 5, "{out}");
    // Same tensor bytes.
    for k in 1..=5 {
        let name = format!("model-{k:05}-of-00005.safetensors");
        let (a, b) = (
            Header::read(ck.join(&name)).unwrap(),
            Header::read(dst.join(&name)).unwrap(),
        );
        for t in &a.tensors {
            assert_eq!(
                a.read_tensor(&t.name).unwrap(),
                b.read_tensor(&t.name).unwrap(),
                "{name} {}",
                t.name
            );
        }
    }
    // One file, and refusals.
    let one = tmp.path().join("one.safetensors");
    let o = run(&[
        "table",
        "pack",
        ck.join("model-00002-of-00005.safetensors")
            .to_str()
            .unwrap(),
        one.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{:?}", text(&o));
    assert_eq!(Header::read(&one).unwrap().data_start, 4096);
    let o = run(&["table", "pack", ck.to_str().unwrap(), dst.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).1.contains("already exists"), "{:?}", text(&o));
    let o = run(&[
        "table",
        "pack",
        tmp.path().join("nope").to_str().unwrap(),
        one.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2));
}
