//! Wrong outputs of one more eager EP round: bf16 with identity experts
//! (every output bit of the combine), fp8 the received rows and counts.

use ferrocomm::device::{Device, DeviceBuffer};
use ferrocomm::ep::reference::dest_ranks;
use ferrocomm::ep::{DispatchOut, EpBuffer, EpConfig, EpPayload};
use ferrocomm::{Call, Communicator, Result, Tensor};

use super::inputs::{x_bytes, Inputs};
use super::RowTensors;

/// One more round of a row, checked: what it runs on and with.
pub struct Round<'a, D: Device> {
    pub comm: &'a Communicator<D>,
    pub ep: &'a EpBuffer<D>,
    pub cfg: &'a EpConfig,
    pub inputs: &'a Inputs,
    pub t: &'a RowTensors<D>,
    pub stream: &'a D::Stream,
}

impl<D: Device> Round<'_, D> {
    /// The round run on the stream, its wrong outputs counted.
    pub fn wrong(&self) -> Result<usize> {
        let (cfg, t, stream) = (self.cfg, self.t, self.stream);
        let on = Call::on(stream);
        let (_, recv) = self
            .ep
            .dispatch(t.x, t.scales, t.idx, t.weights, cfg.max_tokens_per_rank, &on)?;
        if cfg.payload != EpPayload::Bf16 {
            return self.received_wrong(&recv);
        }
        // Identity experts: the received rows are the experts' output; the
        // combine's output poisoned first.
        let dev = self.comm.device();
        dev.copy_device(t.expert.ptr(), recv.recv_x.ptr(), recv.recv_x.bytes()?, stream)?;
        dev.memset(t.out_buf(), 0, cfg.max_tokens_per_rank * cfg.hidden * 2, 0x7F, stream)?;
        self.ep.combine(t.expert, t.out, &on)?;
        self.combined_wrong()
    }

    /// bf16: every token's output must be its row summed over the ranks it
    /// went to (f32, rounded once), bit for bit.
    fn combined_wrong(&self) -> Result<usize> {
        let (comm, cfg, x) = (self.comm, self.cfg, &self.inputs.x);
        let (n, hd) = (cfg.max_tokens_per_rank, cfg.hidden);
        let mut got = vec![0u8; n * hd * 2];
        comm.device().copy_to_host(self.t.out_buf(), 0, &mut got, self.stream)?;
        let mut wrong = 0;
        for tok in 0..n {
            let copies = dest_ranks(cfg, comm.size(), &self.inputs.ids[comm.rank()][tok]).count_ones();
            for c in 0..hd {
                let i = 2 * (tok * hd + c);
                let v = half::bf16::from_le_bytes([x[i], x[i + 1]]).to_f32();
                let mut acc = v;
                for _ in 1..copies {
                    acc += v;
                }
                let want = if copies == 0 {
                    0
                } else {
                    half::bf16::from_f32(acc).to_bits()
                };
                wrong += usize::from(u16::from_le_bytes([got[i], got[i + 1]]) != want);
            }
        }
        Ok(wrong)
    }

    /// fp8: from each source rank, the count and every row (with its token
    /// index) that should have come.
    fn received_wrong(&self, recv: &DispatchOut) -> Result<usize> {
        let (comm, cfg) = (self.comm, self.cfg);
        let (rank, world) = (comm.rank(), comm.size());
        let (n, hd) = (cfg.max_tokens_per_rank, cfg.hidden);
        let counts = self.copy_out(&recv.recv_counts)?;
        let rows = self.copy_out(&recv.recv_x)?;
        let src = self.copy_out(&recv.recv_src_index)?;
        let word = |b: &[u8], i: usize| i32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap_or([0; 4]));
        // The combine keeps the buffer's alternation; its output is not checked here.
        self.ep.combine(self.t.expert, self.t.out, &Call::on(self.stream))?;
        comm.device().synchronize(self.stream)?;
        let mut wrong = 0;
        for (sr, src_ids) in self.inputs.ids.iter().enumerate() {
            let want: Vec<usize> = (0..n)
                .filter(|&tok| dest_ranks(cfg, world, &src_ids[tok]) & (1 << rank) != 0)
                .collect();
            if word(&counts, sr) != want.len() as i32 {
                wrong += want.len().max(1);
                continue;
            }
            for (i, &tok) in want.iter().enumerate() {
                let row = sr * n + i;
                let ok = word(&src, row) == tok as i32 && rows[row * hd..(row + 1) * hd] == x_bytes(cfg, sr, tok)[..];
                wrong += usize::from(!ok);
            }
        }
        Ok(wrong)
    }

    /// A tensor's bytes, through a buffer of our own (it may live in the heap).
    fn copy_out(&self, t: &Tensor) -> Result<Vec<u8>> {
        let dev = self.comm.device();
        let bytes = t.bytes()?;
        let tmp = self.comm.alloc(bytes.max(16))?;
        dev.copy_device(tmp.ptr(), t.ptr(), bytes, self.stream)?;
        let mut v = vec![0u8; bytes];
        dev.copy_to_host(&tmp, 0, &mut v, self.stream)?;
        Ok(v)
    }
}
