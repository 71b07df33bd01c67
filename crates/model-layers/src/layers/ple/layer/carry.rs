//! A carry as bytes: [`PleLayer::snapshot`] and [`PleLayer::restore`]
//! through the one aux blob codec, [`crate::layers::ple::carry_blob`].
//!
//! They write and read the same bytes as the seed's `snapshot_aux` and
//! `restore_aux` (tests hold the two to that), with typed errors; the
//! engine's site and the Python binding use these, so the seed's copy is
//! called by nothing else in the library.
//!
//! Invariant: a refused blob changes nothing; it is checked whole before
//! the carry is touched.

use metrale_gpu_runtime::gpu::{GpuBackend, StreamId};

use super::{DeviceContext, LayerError, PleLayer, PleSeqState, Result};
use crate::layers::ple::carry_blob;

impl PleLayer {
    /// The carry's aux blob: its history (empty for a carry that has not
    /// run) and its conv state, read after the work queued on `stream`.
    pub fn snapshot(
        &self,
        st: &PleSeqState,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> Result<Vec<u8>> {
        self.check_carry(st)?;
        carry_blob::encode_with(&st.history, self.conv_state_bytes(), |conv| {
            gpu.copy_d2h_on_stream(st.conv, conv, stream)
                .device(|| "reading a PLE conv state for a snapshot".into())
        })
    }

    /// Overwrite the carry from a blob of [`Self::snapshot`] (or of a
    /// sequence that ran, [`carry_blob::decode`]), queued on `stream`, and
    /// drop any waiting prestage. A blob that does not fit the site is
    /// refused with [`LayerError::AuxBlob`] and changes nothing.
    pub fn restore(
        &self,
        st: &mut PleSeqState,
        blob: &[u8],
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> Result<()> {
        self.check_carry(st)?;
        let carry = carry_blob::decode_carry(blob, self.spec())?;
        st.history = carry.history_tokens();
        st.prestaged_va = None;
        gpu.copy_h2d_async(carry.conv, st.conv, stream)
            .device(|| "writing a PLE conv state from a blob".into())
    }

    fn check_carry(&self, st: &PleSeqState) -> Result<()> {
        self.check_live()?;
        if st.conv.is_null() {
            return Err(LayerError::Usage("the PLE carry was released".into()));
        }
        Ok(())
    }
}
