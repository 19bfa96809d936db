//! The copy route (`coll_algo copy`, `algo::copy`) in the conformance
//! suite: all-gather (single and list, in place and not), broadcast from
//! every root and all-to-all without splits (in place and not), at sizes of
//! one and several chunks, every result bit for bit against the blocks the
//! ranks sent; the planner's choice of it; and a graph of the three captured
//! once and replayed with fresh inputs. On the host backend the stream's own
//! copies stand in for the copy engines.

use super::collectives::block_bytes;
use super::conformance::{context, Suite, SuiteConfig, SuiteReport};
use crate::comm::{Call, Communicator};
use crate::device::Device;
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::plan::{Algorithm, Collective};

/// The copy route's cases, then a barrier (so no rank releases its
/// workspace while a peer's last copy may still reach it).
pub fn run_copy_route<D: Device>(comm: &Communicator<D>, cfg: &SuiteConfig) -> Result<SuiteReport> {
    let mut s = Suite::new(comm, cfg);
    s.copy_route_planned()?;
    s.copy_route_cases()?;
    let stream = comm.device().create_stream()?;
    s.copy_route_graph(&stream)?;
    comm.barrier(&Call::new())?.wait(Some(cfg.timeout))?;
    s.report.collectives += 1;
    Ok(s.report)
}

/// Per-peer counts of one and several chunks of the route's inboxes for
/// the communicator's slots, and odd ones.
fn counts<D: Device>(comm: &Communicator<D>, size: usize) -> [usize; 4] {
    let slot = comm.options().slot_bytes_for(comm.device().facts().backend);
    let stride = crate::algo::chunk_elems(crate::algo::kernels::KernelKind::Copy, None, slot, comm.size(), 1, 0);
    [1, 4099 / size, stride / size, (stride * 5 / 2 + 7) / size]
}

impl<D: Device> Suite<'_, D> {
    /// Asked for, the route runs the collectives it has; by default the
    /// planner never picks it; a reduce-scatter asking for it is passed on.
    fn copy_route_planned(&mut self) -> Result<()> {
        let comm = self.comm;
        let copy = Some(Algorithm::Copy);
        for coll in [Collective::AllGather, Collective::Broadcast, Collective::AllToAll] {
            let asked = comm.planned_algorithm(coll, 4096, DType::F32, ReduceOp::Sum, copy)?;
            self.check_local_plan(&format!("{coll} asking for copy"), asked == copy, asked)?;
            let auto = comm.planned_algorithm(coll, 4096, DType::F32, ReduceOp::Sum, None)?;
            self.check_local_plan(&format!("{coll} by default"), auto != copy, auto)?;
        }
        let rs = comm.planned_algorithm(Collective::ReduceScatter, 4096, DType::F32, ReduceOp::Sum, copy)?;
        self.check_local_plan("reduce_scatter asking for copy", rs != copy, rs)
    }

    fn check_local_plan(&mut self, case: &str, ok: bool, got: Option<Algorithm>) -> Result<()> {
        self.report.collectives += 1;
        if !ok {
            self.fail(format!("{case}: planned {got:?}"));
        }
        Ok(())
    }

    fn copy_route_cases(&mut self) -> Result<()> {
        for (k, dtype) in [DType::F32, DType::BF16, DType::U8].into_iter().enumerate() {
            for (j, n) in counts(self.comm, dtype.size()).into_iter().enumerate() {
                let tag = (k * 10 + j) as u64;
                self.copy_all_gather(dtype, n, (j + k) % 2 == 1, j % 2 == 0, tag)?;
                self.copy_broadcast(dtype, n, (j + k) % self.comm.size(), tag)?;
                self.copy_all_to_all(dtype, n, (j + k) % 2 == 0, tag)?;
            }
        }
        Ok(())
    }

    fn copy_all_gather(&mut self, dtype: DType, n: usize, in_place: bool, list: bool, tag: u64) -> Result<()> {
        let comm = self.comm;
        let (rank, world, size) = (comm.rank(), comm.size(), dtype.size());
        let case = format!("copy all_gather {dtype} n={n} in_place={in_place} list={list} rank={rank}");
        let blocks: Vec<Vec<u8>> = (0..world)
            .map(|s| block_bytes(self.cfg.seed, s, 9000 + tag, n * size))
            .collect();
        let call = Call::new().coll_algo(Algorithm::Copy);
        let stride = n * size + 67;
        if list {
            // Sized first: growing the buffer under the earlier views would free their memory.
            self.buf(1, world * stride)?;
            let outs = (0..world)
                .map(|s| self.view(1, s * stride, dtype, n, true))
                .collect::<Result<Vec<_>>>()?;
            self.put(0, 5, &blocks[rank])?;
            let inp = self.view(0, 5, dtype, n, false)?;
            comm.all_gather(&outs, inp, &call)?
                .wait(Some(self.cfg.timeout))
                .map_err(|e| context(e, &case))?;
            let mut got = Vec::new();
            for s in 0..world {
                got.extend(self.get(1, s * stride, n * size)?);
            }
            self.check_bytes(&case, &got, &blocks.concat(), true);
            return Ok(());
        }
        let out = self.view(1, 0, dtype, n * world, true)?;
        let inp = if in_place {
            self.put(1, rank * n * size, &blocks[rank])?;
            out.slice(rank * n, n)?
        } else {
            self.put(0, 0, &blocks[rank])?;
            self.view(0, 0, dtype, n, false)?
        };
        comm.all_gather_single(out, inp, &call)?
            .wait(Some(self.cfg.timeout))
            .map_err(|e| context(e, &case))?;
        let got = self.get(1, 0, n * world * size)?;
        self.check_bytes(&case, &got, &blocks.concat(), true);
        Ok(())
    }

    fn copy_broadcast(&mut self, dtype: DType, n: usize, root: usize, tag: u64) -> Result<()> {
        let comm = self.comm;
        let rank = comm.rank();
        let case = format!("copy broadcast {dtype} n={n} root={root} rank={rank}");
        let src = block_bytes(self.cfg.seed, root, 9100 + tag, n * dtype.size());
        let out = self.view(1, 3, dtype, n, true)?;
        if rank == root {
            self.put(0, 0, &src)?;
        }
        let inp = self.view(0, 0, dtype, n, false)?;
        comm.broadcast_into(inp, out, root, &Call::new().coll_algo(Algorithm::Copy))?
            .wait(Some(self.cfg.timeout))
            .map_err(|e| context(e, &case))?;
        let got = self.get(1, 3, n * dtype.size())?;
        self.check_bytes(&case, &got, &src, true);
        Ok(())
    }

    fn copy_all_to_all(&mut self, dtype: DType, n: usize, in_place: bool, tag: u64) -> Result<()> {
        let comm = self.comm;
        let (rank, world, size) = (comm.rank(), comm.size(), dtype.size());
        let case = format!("copy all_to_all {dtype} n={n} in_place={in_place} rank={rank}");
        let block = |s: usize, d: usize| block_bytes(self.cfg.seed, s, 9200 + tag * 16 + d as u64, n * size);
        let input: Vec<u8> = (0..world).flat_map(|d| block(rank, d)).collect();
        let want: Vec<u8> = (0..world).flat_map(|s| block(s, rank)).collect();
        self.put(0, 0, &input)?;
        let inp = self.view(0, 0, dtype, n * world, false)?;
        let (out, slot) = match in_place {
            true => (inp, 0),
            false => (self.view(1, 0, dtype, n * world, true)?, 1),
        };
        comm.all_to_all_single(out, inp, &Call::new().hint("coll_algo", "copy"))?
            .wait(Some(self.cfg.timeout))
            .map_err(|e| context(e, &case))?;
        let got = self.get(slot, 0, n * world * size)?;
        self.check_bytes(&case, &got, &want, false);
        Ok(())
    }

    /// All-gather, broadcast and all-to-all on the copy route captured into
    /// one graph and replayed: the copies' addresses are fixed at capture,
    /// the epochs advance on the device.
    fn copy_route_graph(&mut self, stream: &D::Stream) -> Result<()> {
        let comm = self.comm;
        let dev = comm.device();
        let (rank, world) = (comm.rank(), comm.size());
        let n = 1001;
        let root = world - 1;
        let ag_in = self.view(0, 0, DType::BF16, n, false)?;
        let ag_out = self.view(1, 0, DType::BF16, n * world, false)?;
        let bc = self.view(2, 0, DType::U8, n, false)?;
        let a2a_in = self.view(3, 0, DType::I32, n * world, false)?;
        let a2a_out = self.view(4, 0, DType::I32, n * world, false)?;
        let call = Call::on(stream).coll_algo(Algorithm::Copy);
        dev.begin_capture(stream)?;
        let captured = comm
            .all_gather_single(ag_out, ag_in, &call)
            .and_then(|_| comm.broadcast(bc, root, &call))
            .and_then(|_| comm.all_to_all_single(a2a_out, a2a_in, &call));
        let graph = dev.end_capture(stream)?;
        captured?;
        for replay in 0..self.cfg.graph_replays.max(2) {
            let case = format!("copy route graph replay {replay} rank={rank}");
            let seed = self.cfg.seed ^ (replay as u64 + 11).wrapping_mul(0x5851_f42d);
            let ag: Vec<Vec<u8>> = (0..world).map(|s| block_bytes(seed, s, 1, n * 2)).collect();
            let bc_src = block_bytes(seed, root, 2, n);
            let a2a: Vec<Vec<u8>> = (0..world).map(|s| block_bytes(seed, s, 3, n * world * 4)).collect();
            let bc_in = if rank == root { bc_src.clone() } else { vec![0; n] };
            for (slot, bytes) in [(0, &ag[rank]), (2, &bc_in), (3, &a2a[rank])] {
                let Some(Some(b)) = self.bufs_at(slot) else { continue };
                dev.copy_from_host(b, 0, bytes, stream)?;
            }
            dev.launch_graph(&graph, stream)?;
            dev.synchronize(stream).map_err(|e| context(e, &case))?;
            let got = self.get(1, 0, n * world * 2)?;
            self.check_bytes(&format!("{case}: all_gather"), &got, &ag.concat(), true);
            let got = self.get(2, 0, n)?;
            self.check_bytes(&format!("{case}: broadcast"), &got, &bc_src, true);
            let got = self.get(4, 0, n * world * 4)?;
            let want: Vec<u8> = (0..world)
                .flat_map(|s| a2a[s][rank * n * 4..(rank + 1) * n * 4].to_vec())
                .collect();
            self.check_bytes(&format!("{case}: all_to_all"), &got, &want, false);
        }
        Ok(())
    }
}
