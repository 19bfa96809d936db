//! The `--coll` table: a row's columns, nccl-tests' bandwidths, the header
//! and rows as rank 0 prints them, and what follows the sweep (the plain
//! vs heap pairs, `--json`, `--plot`).

use std::fmt::Write as _;

use ferrocomm::device::{BackendKind, Device};
use ferrocomm::{Communicator, DType, Error, ReduceOp, Result};

use crate::args::{Args, Operands};
use crate::colls::Coll;
use crate::plot;

pub struct Row {
    pub coll: Coll,
    pub bytes: usize,
    pub count: usize,
    pub dtype: DType,
    pub op: ReduceOp,
    pub algo: String,
    pub mode: &'static str,
    pub time_us: f64,
    pub cpu_us: f64,
    /// Elements that differ from the reference; `None`: not bitwise comparable.
    pub wrong: Option<usize>,
    /// ‖out − exact‖ / ‖exact‖ against an fp64 sum (with `--quantization`).
    pub relerr: Option<f64>,
    /// Where the row's buffers lived (`--operands`).
    pub operands: Operands,
}

/// (algbw, busbw) in GB/s: busbw is nccl-tests' factor of the collective
/// (2(n-1)/n for all-reduce, ...); a memcpy moves its bytes once, so its
/// busbw is its algbw.
fn bandwidths(row: &Row, world: usize) -> (f64, f64) {
    let algbw = row.bytes as f64 / (row.time_us * 1e-6) / 1e9;
    let factor = if row.algo == "memcpy" {
        1.0
    } else {
        row.coll.busbw_factor(world)
    };
    (algbw, algbw * factor)
}

/// `--operands` as the header and the JSON show it.
fn operands_label(a: &Args) -> String {
    a.operands.iter().map(|o| o.name()).collect::<Vec<_>>().join(",")
}

/// The run's line and the columns' names.
pub fn print_header<D: Device>(comm: &Communicator<D>, a: &Args, backend: BackendKind) {
    let direct_min = comm.options().direct_min_bytes;
    println!(
        "# ferrocomm-bench backend={} world={} iters={} warmup={} operands={} direct_min_bytes={} ({})",
        a.backend,
        a.world,
        a.iters_for(backend),
        a.warmup_for(backend),
        operands_label(a),
        direct_min.map_or("default".to_string(), |n| n.to_string()),
        comm.device().facts().name
    );
    println!(
        "{:>14} {:>12} {:>12} {:>6} {:>5} {:>20} {:>8} {:>6} {:>10} {:>9} {:>9} {:>8} {:>7} {:>8}",
        "coll",
        "size",
        "count",
        "dtype",
        "op",
        "algo",
        "operands",
        "mode",
        "time_us",
        "algbw",
        "busbw",
        "cpu_us",
        "#wrong",
        "relerr"
    );
}

pub fn print_row(r: &Row, world: usize) {
    let (algbw, busbw) = bandwidths(r, world);
    let wrong = r.wrong.map_or("-".to_string(), |w| w.to_string());
    let relerr = r.relerr.map_or("-".to_string(), |e| format!("{e:.4}"));
    let op = if r.coll.reduces() { r.op.name() } else { "-" };
    println!(
        "{:>14} {:>12} {:>12} {:>6} {:>5} {:>20} {:>8} {:>6} {:>10.2} {:>9.2} {:>9.2} {:>8.2} {:>7} {:>8}",
        r.coll.name(),
        r.bytes,
        r.count,
        r.dtype,
        op,
        r.algo,
        r.operands.name(),
        r.mode,
        r.time_us,
        algbw,
        busbw,
        r.cpu_us,
        wrong,
        relerr
    );
}

/// Rank 0's reports after the sweep: the plain vs heap pairs (with
/// `--operands both`), the JSON file, the plot.
pub fn report<D: Device>(comm: &Communicator<D>, a: &Args, rows: &[Row]) -> Result<()> {
    if a.operands.len() > 1 {
        print_pairs(rows);
    }
    if let Some(path) = &a.json {
        std::fs::write(path, to_json(rows, a, comm.options().direct_min_bytes))
            .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
    }
    if let Some(path) = &a.plot {
        let points: Vec<plot::Point> = rows.iter().map(|r| point(r, a)).collect();
        let dtypes: Vec<&str> = a.dtypes.iter().map(|d| d.name()).collect();
        let names: Vec<&str> = a.colls.iter().map(|c| c.name()).collect();
        let title = format!(
            "{} {} {}, {} backend, world {} ({})",
            names.join("/"),
            dtypes.join("/"),
            a.op,
            a.backend,
            a.world,
            comm.device().facts().name
        );
        plot::write_svg(path, &title, &points)?;
        println!("# plot written to {}", path.display());
    }
    Ok(())
}

/// A row's point on the plot: one series per collective (when several),
/// algorithm, operands and mode; "auto:oneshot" and "auto:twoshot-push"
/// are one line, "auto".
fn point(r: &Row, a: &Args) -> plot::Point {
    let coll = if a.colls.len() > 1 {
        format!("{} ", r.coll.name())
    } else {
        String::new()
    };
    let heap = match r.operands {
        Operands::Heap => "+heap",
        Operands::Plain => "",
    };
    plot::Point {
        series: format!("{coll}{}{heap} {}", r.algo.split(':').next().unwrap_or(&r.algo), r.mode),
        bytes: r.bytes,
        busbw: bandwidths(r, a.world).1,
    }
}

/// With `--operands both`: each heap row beside its plain twin (same
/// collective, size, dtype, algorithm and mode), slowest rank's median us.
fn print_pairs(rows: &[Row]) {
    let heap_rows = rows.iter().filter(|r| r.operands == Operands::Heap);
    println!("# plain vs heap operands (the inbox way vs the direct kinds where they apply)");
    println!(
        "# {:>12} {:>12} {:>6} {:>20} {:>6} {:>10} {:>10} {:>11}",
        "coll", "size", "dtype", "algo", "mode", "plain_us", "heap_us", "plain/heap"
    );
    for h in heap_rows {
        let twin = rows.iter().find(|p| {
            p.operands == Operands::Plain
                && p.coll == h.coll
                && p.bytes == h.bytes
                && p.dtype == h.dtype
                && p.algo == h.algo
                && p.mode == h.mode
        });
        if let Some(p) = twin {
            println!(
                "# {:>12} {:>12} {:>6} {:>20} {:>6} {:>10.2} {:>10.2} {:>11.3}",
                h.coll.name(),
                h.bytes,
                h.dtype,
                h.algo,
                h.mode,
                p.time_us,
                h.time_us,
                p.time_us / h.time_us
            );
        }
    }
}

fn to_json(rows: &[Row], a: &Args, direct_min: Option<usize>) -> String {
    let mut s = format!(
        "{{\"backend\":\"{}\",\"world\":{},\"iters\":{},\"operands\":\"{}\",\"direct_min_bytes\":{},\"rows\":[",
        a.backend,
        a.world,
        a.iters.map_or("\"default\"".to_string(), |i| i.to_string()),
        operands_label(a),
        direct_min.map_or("null".to_string(), |n| n.to_string())
    );
    for (i, r) in rows.iter().enumerate() {
        let (algbw, busbw) = bandwidths(r, a.world);
        let _ = write!(
            s,
            "{}{{\"coll\":\"{}\",\"size\":{},\"count\":{},\"dtype\":\"{}\",\"op\":\"{}\",\"algo\":\"{}\",\"operands\":\"{}\",\"mode\":\"{}\",\"time_us\":{:.3},\"algbw\":{:.3},\"busbw\":{:.3},\"cpu_us\":{:.3},\"wrong\":{},\"relerr\":{}}}",
            if i == 0 { "" } else { "," },
            r.coll.name(),
            r.bytes,
            r.count,
            r.dtype,
            r.op,
            r.algo,
            r.operands.name(),
            r.mode,
            r.time_us,
            algbw,
            busbw,
            r.cpu_us,
            r.wrong.map_or("null".to_string(), |w| w.to_string()),
            r.relerr.map_or("null".to_string(), |e| format!("{e:.6}"))
        );
    }
    s.push_str("]}\n");
    s
}
