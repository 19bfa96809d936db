//! One-sided windows on the symmetric heap, on the host backend (no GPU):
//! four ranks as threads, each puts a row into the next rank's window and
//! signals it, then reads what the previous rank put. On GPUs the same code
//! runs with `CudaDevice`/`HipDevice` in place of `HostDevice`.
//!
//! ```sh
//! cargo run --example windows_host
//! ```

use ferrocomm::backends::host::HostDevice;
use ferrocomm::testing::harness::run_thread_ranks;
use ferrocomm::{Call, CommOptions, Communicator, DType, Result, Tensor};

const ROW: usize = 8;

fn rank_main(rank: usize, world: usize, store: std::sync::Arc<dyn ferrocomm::bootstrap::Store>) -> Result<String> {
    let comm = Communicator::new(
        HostDevice::new(rank)?,
        store,
        rank,
        world,
        CommOptions::default().with_heap_bytes(1 << 20),
    )?;
    // A symmetric buffer: one row per rank, the same offset everywhere.
    let rows = comm.heap_alloc(world * ROW * 4)?;
    let mut win = comm.new_window()?;
    win.register(Tensor::of(&rows, DType::I32))?;

    // This rank's row, in ordinary device memory.
    let src = comm.alloc(ROW * 4)?;
    let mine: Vec<u8> = (0..ROW).flat_map(|i| ((rank * 100 + i) as i32).to_le_bytes()).collect();
    comm.write(&src, 0, &mine)?;

    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    let call = Call::new();
    win.put(Tensor::of(&src, DType::I32), next, rank * ROW, &call)?;
    win.signal(next, &call)?;
    win.wait_signal(prev, &call)?.wait(None)?;

    let mut got = vec![0u8; ROW * 4];
    comm.heap_read(&rows, prev * ROW * 4, &mut got)?;
    let row: Vec<i32> = got
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    win.free()?;
    comm.heap_free(rows)?;
    comm.finalize()?;
    Ok(format!("rank {rank} got rank {prev}'s row {row:?}"))
}

fn main() -> std::process::ExitCode {
    let mut ok = true;
    for r in run_thread_ranks(4, rank_main) {
        match r {
            Ok(line) => println!("{line}"),
            Err(e) => {
                ok = false;
                eprintln!("error: {e}");
            }
        }
    }
    if ok {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}
