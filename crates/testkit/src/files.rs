//! Finding and damaging checkpoint files on purpose, for tests of refusals.
//!
//! Invariant: a rewritten file keeps every other tensor's name, dtype,
//! shape and bytes, so a refusal can only come from the tensor changed.

use std::path::{Path, PathBuf};

use metrale_storage::safetensors::{Header, TensorSpec, write_file};

/// Rewrite the safetensors `file` with tensor `name` replaced by
/// `(spec, data)`. Panics on I/O errors (test code wants the failure loud).
pub fn replace_tensor(file: &Path, name: &str, spec: TensorSpec, data: Vec<u8>) {
    let h = Header::read(file).unwrap();
    let mut tensors: Vec<(TensorSpec, Vec<u8>)> = Vec::new();
    for t in &h.tensors {
        if t.name == name {
            tensors.push((spec.clone(), data.clone()));
        } else {
            tensors.push((
                TensorSpec::new(&t.name, t.dtype, &t.shape),
                h.read_tensor(&t.name).unwrap(),
            ));
        }
    }
    let refs: Vec<(TensorSpec, &[u8])> = tensors
        .iter()
        .map(|(s, d)| (s.clone(), d.as_slice()))
        .collect();
    write_file(file, &refs, 8).unwrap();
}

/// Rewrite the safetensors `file` with tensor `name` given a new `shape`
/// (same dtype, zero data).
pub fn reshape_tensor(file: &Path, name: &str, shape: &[u64]) {
    let h = Header::read(file).unwrap();
    let t = h.get(name).unwrap();
    let spec = TensorSpec::new(name, t.dtype, shape);
    let n = spec.bytes().unwrap() as usize;
    replace_tensor(file, name, spec, vec![0u8; n]);
}

/// The safetensors file of checkpoint `ck` whose header holds `tensor`
/// (found by reading the headers, so also for tensors the index omits).
///
/// # Panics
///
/// When no file holds it.
pub fn file_of(ck: &Path, tensor: &str) -> PathBuf {
    for e in std::fs::read_dir(ck).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors")
            && Header::read(&p).unwrap().tensor(tensor).is_some()
        {
            return p;
        }
    }
    panic!("{tensor} is in no file of {}", ck.display());
}
