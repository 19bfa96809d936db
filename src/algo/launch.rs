//! Turning one collective call into kernel launches: chunking, fingerprints
//! and the parameter block.

use std::time::Duration;

use super::grid::GridTable;
use super::kernels::{kernel_name, qr_codec_index, quick_reduce_name, KernelKind, QR_CODECS, QR_DTYPES};
use super::layout::{
    ll_stride, push_oneshot_stride, push_twoshot_stride, qr_segment_blocks, segment_elems, DATA_OFFSET, FLAGS_OFFSET,
    FP_OFFSET,
};
use super::workspace::Workspace;
use crate::codec::{Codec, BLOCK};
use crate::device::{Device, DeviceBuffer, DevicePtr, HostFlags, KernelParams, MAX_RANKS};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;

/// Entry-point names, built once so the hot path does not format strings.
pub struct KernelNames {
    names: Vec<String>,
    /// Quick-reduce, indexed like `QR_CODECS` x `QR_DTYPES`.
    qr: Vec<String>,
}

impl KernelNames {
    pub fn new() -> Self {
        let mut names = Vec::new();
        for kind in KernelKind::ALL {
            for dtype in DType::ALL {
                for op in ReduceOp::ALL {
                    names.push(kernel_name(kind, dtype, op));
                }
            }
        }
        let qr = QR_CODECS
            .iter()
            .flat_map(|&c| QR_DTYPES.iter().map(move |&d| quick_reduce_name(c, d)))
            .collect();
        KernelNames { names, qr }
    }

    /// The entry point of a call: quick-reduce names carry the codec.
    pub fn get(&self, kind: KernelKind, dtype: DType, op: ReduceOp, codec: Option<Codec>) -> &str {
        if let (KernelKind::QuickReduce, Some(codec)) = (kind, codec) {
            let c = qr_codec_index(codec);
            let d = QR_DTYPES.iter().position(|&x| x == dtype).unwrap_or(0);
            return &self.qr[c * QR_DTYPES.len() + d];
        }
        let k = KernelKind::ALL.iter().position(|&x| x == kind).unwrap_or(0);
        &self.names[(k * DType::ALL.len() + dtype as usize) * ReduceOp::ALL.len() + op as usize]
    }
}

impl Default for KernelNames {
    fn default() -> Self {
        Self::new()
    }
}

/// What one rank asks for; every rank of the group must ask for the same.
#[derive(Debug, Clone, Copy)]
pub struct CollectiveCall {
    pub kind: KernelKind,
    pub dtype: DType,
    pub op: ReduceOp,
    pub count: usize,
    pub root: usize,
    pub input: DevicePtr,
    pub output: DevicePtr,
    /// Quick-reduce's codec (`None` for every other kind).
    pub codec: Option<Codec>,
    /// premul_sum's factor (`KernelParams::scalar`) and `PARAM_*` flags.
    pub scalar: u64,
    pub flags: u32,
    /// Per-peer lists of the host protocols (`KernelParams::per_peer`).
    pub per_peer: [[u64; MAX_RANKS]; 4],
    /// `KernelParams::table` (the direct kinds' heap bases), or null.
    pub table: DevicePtr,
}

impl CollectiveCall {
    /// A call of `kind` with no codec, factor or lists.
    pub fn new(
        kind: KernelKind,
        dtype: DType,
        op: ReduceOp,
        count: usize,
        input: DevicePtr,
        output: DevicePtr,
    ) -> Self {
        CollectiveCall {
            kind,
            dtype,
            op,
            count,
            root: 0,
            input,
            output,
            codec: None,
            scalar: 0,
            flags: 0,
            per_peer: [[0; MAX_RANKS]; 4],
            table: DevicePtr::NULL,
        }
    }
}

/// 64-bit FNV-1a over what must agree across ranks for one launch.
pub fn fingerprint(call: &CollectiveCall, chunk: usize) -> u64 {
    let words = [
        call.kind as u64,
        call.dtype as u64,
        call.op as u64,
        call.count as u64,
        chunk as u64,
        call.root as u64,
        call.codec.map_or(0, |c| qr_codec_index(c) as u64 + 1),
    ];
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in words {
        for b in w.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Codec blocks per quick-reduce segment (`KernelParams::aux`).
fn qr_blocks(codec: Option<Codec>, slot_bytes: usize, world: usize, chunk_bytes: usize) -> usize {
    let code_bytes = codec.map_or(32, |c| c.code_bytes());
    qr_segment_blocks(code_bytes, slot_bytes, world.max(1), chunk_bytes)
}

/// Most elements one launch of `kind` may carry, for a workspace of
/// `slot_bytes` per slot shared by `world` ranks (docs/protocol.md,
/// "Chunking"). Depends only on what every rank agrees on. `chunk_bytes`:
/// quick-reduce's largest chunk, encoded ([`GridTable::qr_chunk_bytes`]).
pub fn chunk_elems(
    kind: KernelKind,
    codec: Option<Codec>,
    slot_bytes: usize,
    world: usize,
    elem: usize,
    chunk_bytes: usize,
) -> usize {
    let world = world.max(1);
    let elems = match kind {
        // Whole segments of `capb` codec blocks each (docs/quick-reduce.md).
        KernelKind::QuickReduce => world * BLOCK * qr_blocks(codec, slot_bytes, world, chunk_bytes),
        KernelKind::OneShot | KernelKind::TwoShot | KernelKind::Broadcast => slot_bytes / elem,
        KernelKind::OneShotPush => push_oneshot_stride(slot_bytes, world) / elem,
        // Each source's inbox holds one segment; whole segments per launch.
        KernelKind::TwoShotPush => world * (push_twoshot_stride(slot_bytes, world) / elem),
        // An LL unit carries 4 data bytes in 8.
        KernelKind::OneShotLl | KernelKind::ExchangeLl | KernelKind::ReduceToLl => {
            ll_stride(slot_bytes, world) / 2 / elem
        }
        // Per peer and chunk: one inbox (the host protocols loop over chunks).
        KernelKind::Exchange | KernelKind::ExchangeDirect | KernelKind::ReduceTo | KernelKind::ReduceToDirect => {
            push_twoshot_stride(slot_bytes, world) / elem
        }
        KernelKind::SendRecv => super::layout::p2p_half_bytes(slot_bytes) / elem,
        // Per peer and chunk: one inbox in parity region 0 (`algo::copy`).
        KernelKind::Copy => super::copy::inbox_stride(slot_bytes, world) / elem,
    };
    debug_assert!(kind != KernelKind::TwoShotPush || segment_elems(elems, world) * elem <= slot_bytes / world);
    elems.max(1)
}

/// Whether one launch of `kind` carries a whole call, looping over chunks of
/// [`chunk_elems`] inside the kernel (one epoch per chunk), instead of one
/// launch per chunk.
pub const fn whole_call(kind: KernelKind) -> bool {
    matches!(
        kind,
        KernelKind::OneShotPush
            | KernelKind::TwoShotPush
            | KernelKind::QuickReduce
            | KernelKind::Exchange
            | KernelKind::ExchangeDirect
            | KernelKind::ReduceTo
            | KernelKind::ReduceToDirect
            | KernelKind::ExchangeLl
            | KernelKind::ReduceToLl
            | KernelKind::SendRecv
    )
}

impl CollectiveCall {
    /// Enqueue the launches for this call on `stream`: one per workspace-sized
    /// chunk, or one in all for the kinds that loop over chunks themselves.
    #[allow(clippy::too_many_arguments)]
    pub fn enqueue<D: Device>(
        &self,
        dev: &D,
        module: &D::Module,
        names: &KernelNames,
        grids: &GridTable,
        ws: &Workspace<D>,
        flags: &D::Flags,
        rank: usize,
        timeout: Duration,
        stream: &D::Stream,
    ) -> Result<()> {
        let elem = self.dtype.size();
        let chunk_bytes = grids.qr_chunk_bytes();
        let chunk_elems = chunk_elems(self.kind, self.codec, ws.slot_bytes(), ws.world(), elem, chunk_bytes);
        let name = names.get(self.kind, self.dtype, self.op, self.codec);
        let base = KernelParams {
            peer_ws: ws.peer_ptrs(),
            error_flags: flags.device_ptr(),
            timeout_ns: timeout.as_nanos().min(u64::MAX as u128) as u64,
            fp_offset: FP_OFFSET as u64,
            flags_offset: FLAGS_OFFSET as u64,
            data_offset: DATA_OFFSET as u64,
            slot_bytes: ws.slot_bytes() as u64,
            rank: rank as u32,
            world: ws.world() as u32,
            dtype: self.dtype as u32,
            op: self.op as u32,
            root: self.root as u32,
            aux: match self.codec {
                Some(_) => qr_blocks(self.codec, ws.slot_bytes(), ws.world(), chunk_bytes) as u32,
                None => 0,
            },
            scalar: self.scalar,
            flags: self.flags,
            per_peer: self.per_peer,
            table: self.table,
            ..KernelParams::default()
        };
        if self.kind == KernelKind::Copy {
            let route = super::copy::Route {
                dev,
                module,
                name,
                ws,
                rank,
                stream,
                base,
            };
            return route.enqueue(self);
        }
        if KernelKind::HOST_PROTOCOLS.contains(&self.kind) {
            // One launch carries the whole call, even an empty one: only the
            // group knows whether any rank moves anything (docs/protocol.md).
            let params = KernelParams {
                input: self.input,
                output: self.output,
                count: self.count as u64,
                fingerprint: fingerprint(self, 0),
                ..base
            };
            // Every rank must launch the same grid (block b pairs with block
            // b): sized by the per-peer block when the group agrees on one
            // (`count`, which the fingerprint checks), else for a full chunk.
            let agreed = match self.count {
                0 => chunk_elems,
                n => n.min(chunk_elems),
            };
            return dev.launch(module, name, grids.grid(self.kind, agreed * elem), &params, stream);
        }
        debug_assert!(ws.own().len() >= DATA_OFFSET);
        // The grid is sized for one chunk (a whole-call launch loops over chunks).
        let grid = grids.grid(self.kind, chunk_elems.min(self.count) * elem);
        let per_launch = if whole_call(self.kind) { self.count } else { chunk_elems };
        let mut first = 0;
        let mut chunk = 0;
        while first < self.count {
            let n = per_launch.min(self.count - first);
            let params = KernelParams {
                input: self.input.offset(first * elem),
                output: self.output.offset(first * elem),
                count: n as u64,
                fingerprint: fingerprint(self, chunk),
                ..base
            };
            let grid = if n < chunk_elems {
                grids.grid(self.kind, n * elem)
            } else {
                grid
            };
            dev.launch(module, name, grid, &params, stream)?;
            first += n;
            chunk += 1;
        }
        Ok(())
    }
}
