//! `--heap`: the symmetric heap's data paths, timed as the other rows are
//! (device events around a sample of back-to-back launches, or one replay
//! of a graph holding them; median over iterations):
//!
//! - a device put (`fc_put_block` from a kernel over the device API) into the
//!   next rank's heap, next to the floor it must reach: a copy-engine copy of
//!   the same bytes into the same peer mapping (`copy_device`);
//! - the user-style all-gather (`kernels-cuda/examples/user_allgather.cu`,
//!   compiled at run time) next to ferrocomm's own `all_gather`.
//!
//! Every rank sends at once (to rank + 1), as in a collective. Kernels over
//! the device API need a GPU: on the host backend only the copy rows run.

use ferrocomm::algo::layout::MAX_BLOCKS;
use ferrocomm::device::{BackendKind, Device, DeviceBuffer};
use ferrocomm::heap::DevCtx;
use ferrocomm::testing::heap::UserAllgather;
use ferrocomm::{Call, Communicator, DType, Error, Result, Tensor};

use crate::args::Args;
use crate::timing::{median, ops_per_sample, time_samples};

/// A device put of `bytes`, split evenly over the blocks.
const PUT_SOURCE: &str = include_str!("../../../kernels-cuda/examples/put_bench.cu");

#[derive(Clone, Copy)]
#[repr(C)]
struct PutArgs {
    ctx: DevCtx,
    src: u64,
    dst: u64,
    bytes: u64,
    peer: u32,
    pad: u32,
}

const _: () = assert!(std::mem::size_of::<PutArgs>() == 136);

fn bytes_of<T: Copy>(v: &T) -> &[u8] {
    // SAFETY: callers pass #[repr(C)] structs of integers with no padding
    // (their sizes are asserted), viewed as their bytes for a launch.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
}

/// Blocks of a launch per size: 256 KiB a block, at most `cap`.
fn blocks_for(bytes: usize, cap: usize) -> u32 {
    (bytes / (256 << 10)).clamp(1, cap) as u32
}

/// The device put's cap: the most a device-API launch takes. A block's
/// stores to a peer drain at a rate of their own: at 256 MiB, graph replay,
/// 32 blocks put 351.9-352.2 GB/s, 64 362.5-362.8 and 128 366.4-366.5,
/// against the copy engine's 390.7 (2x H200; BENCHMARKS.md, "Heap put",
/// `bench/heap-put-2x-h200-2026-11-28/put-grid.log`).
const PUT_MAX_BLOCKS: usize = MAX_BLOCKS;

/// The user all-gather's cap (the heap suite checks its output at grids up
/// to 16; the example's own loop makes any grid correct).
const USER_AG_MAX_BLOCKS: usize = 32;

pub fn bench_heap<D: Device>(comm: &Communicator<D>, a: &Args) -> Result<()> {
    let (rank, world) = (comm.rank(), comm.size());
    if world < 2 {
        return Err(Error::invalid("--heap needs a world of at least 2"));
    }
    let dev = comm.device();
    let backend = dev.facts().backend;
    let max = a.max_bytes.max(4096);
    let src = comm.alloc(max)?;
    let dst = comm.heap_alloc(max)?;
    let next = (rank + 1) % world;
    let peer_dst = comm.translate(dst.ptr(), next)?;
    let put = match backend {
        BackendKind::Host => None,
        _ => Some(comm.load_user_module("put_bench", PUT_SOURCE)?),
    };
    let user_ag = match backend {
        BackendKind::Host => None,
        _ => Some(UserAllgather::new(comm, max / world)?),
    };
    let ag_out = comm.alloc(max)?;
    let stream = dev.create_stream()?;
    let call = Call::on(&stream);
    if rank == 0 {
        println!(
            "# ferrocomm-bench heap backend={} world={world} iters={} ({})",
            a.backend,
            a.iters_for(backend),
            dev.facts().name
        );
        if put.is_none() {
            println!("# device-API rows need a GPU backend (the host runs no CUDA/HIP source): copy rows only");
        }
        println!(
            "{:>12} {:>6} {:>12} {:>10} {:>10} {:>7}",
            "bytes", "mode", "what", "time_us", "GB/s", "blocks"
        );
    }
    let mut bytes = a.min_bytes.max(4096).next_power_of_two();
    while bytes <= max {
        let ops = ops_per_sample(backend, bytes);
        for &mode in a.modes() {
            let row = |what: &str, blocks: u32, run: &dyn Fn(usize) -> Result<()>| -> Result<()> {
                let (mut t, _) = time_samples(comm, a, mode, &stream, ops, run)?;
                let us = median(&mut t);
                if rank == 0 {
                    println!(
                        "{bytes:>12} {mode:>6} {what:>12} {us:>10.2} {:>10.1} {blocks:>7}",
                        bytes as f64 / us / 1e3
                    );
                }
                Ok(())
            };
            row("ce-copy", 0, &|_| dev.copy_device(peer_dst, src.ptr(), bytes, &stream))?;
            if let Some(m) = &put {
                let args = PutArgs {
                    ctx: comm.device_ctx()?,
                    src: src.ptr().0,
                    dst: dst.ptr().0,
                    bytes: bytes as u64,
                    peer: next as u32,
                    pad: 0,
                };
                let blocks = blocks_for(bytes, PUT_MAX_BLOCKS);
                // SAFETY: PutArgs is the kernel's struct; src and dst hold `bytes`.
                row("device-put", blocks, &|_| unsafe {
                    comm.launch_user(m, "put_bench", blocks, 512, bytes_of(&args), &call)
                        .map(drop)
                })?;
            }
            let per_rank = bytes / world;
            if per_rank >= 1 {
                let inp = Tensor::view(&src, DType::U8, 0, per_rank)?;
                let out = Tensor::view(&ag_out, DType::U8, 0, per_rank * world)?;
                row("all_gather", 0, &|_| comm.all_gather_single(out, inp, &call).map(drop))?;
                if let Some(ag) = &user_ag {
                    let blocks = blocks_for(per_rank, USER_AG_MAX_BLOCKS);
                    row("user-ag", blocks, &|_| {
                        ag.launch(comm, inp, per_rank, blocks, &call).map(drop)
                    })?;
                }
            }
        }
        bytes *= 4;
    }
    dev.synchronize(&stream)?;
    if let Some(ag) = user_ag {
        ag.free(comm)?;
    }
    comm.heap_free(dst)
}
