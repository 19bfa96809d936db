//! The `--coll` sweep: for each `--operands` (plain first), collective,
//! dtype and size, every subject (ferrocomm's algorithms, NCCL called
//! directly, a memcpy) in every mode; each row measured, judged, agreed
//! across ranks and printed by rank 0 as it comes.

use std::io::Write as _;
use std::sync::Arc;

use ferrocomm::bootstrap::Store;
use ferrocomm::device::Device;
use ferrocomm::{Algorithm, Communicator, DType, Error, Result};

use crate::args::{Args, Operands};
use crate::check::{algo_label, judge, Expected};
use crate::colls::{self, Coll};
use crate::measure::{measure, Case, Subject};
use crate::operands::HeapOperands;
use crate::plot::human_bytes;
use crate::table::{self, Row};
use crate::timing::RankFigures;

/// What the rows of one rank time, and with what.
struct Sweep<'c, D: Device> {
    comm: &'c Communicator<D>,
    store: &'c Arc<dyn Store>,
    a: &'c Args,
    /// What the rows time, each with its name in the algo column.
    subjects: Vec<(String, Subject)>,
}

/// The rows measured so far, and rank 0's progress line.
struct Rows {
    done: Vec<Row>,
    progress: Progress,
}

pub fn bench_colls<D: Device>(comm: &Communicator<D>, store: &Arc<dyn Store>, a: &Args) -> Result<()> {
    let (rank, backend) = (comm.rank(), comm.device().facts().backend);
    let sweep = Sweep {
        comm,
        store,
        a,
        subjects: subjects(comm, a)?,
    };
    let mut rows = Rows {
        done: Vec::new(),
        progress: Progress::new(rank, rows_total(a, &sweep.subjects)),
    };
    if rank == 0 {
        table::print_header(comm, a, backend);
    }
    // Plain rows first; the heap is reserved when the heap rows start: a
    // communicator with a heap launches the direct kinds on plain buffers
    // too (to fall back), so plain rows after it would not time the inbox way.
    let mut heap: Option<HeapOperands> = None;
    for (on, coll) in a.operands.iter().flat_map(|&on| a.colls.iter().map(move |&c| (on, c))) {
        if on == Operands::Heap && heap.is_none() {
            heap = Some(HeapOperands::alloc(comm, a)?);
        }
        sweep.coll_rows(on, coll, heap.as_ref(), &mut rows)?;
    }
    if let Some(h) = heap {
        comm.device().synchronize(comm.stream())?;
        h.free(comm)?;
    }
    rows.progress.finish();
    comm.finalize()?;
    if rank == 0 {
        table::report(comm, a, &rows.done)?;
    }
    let wrong: usize = rows.done.iter().filter_map(|r| r.wrong).sum();
    if wrong > 0 {
        return Err(Error::Aborted(format!("{wrong} wrong elements in total")));
    }
    Ok(())
}

/// The subjects of the rows: each `--algo` (NCCL through ferrocomm and
/// called directly, where it is loaded), a quick-reduce per
/// `--quantization` codec, and the memcpy.
fn subjects<D: Device>(comm: &Communicator<D>, a: &Args) -> Result<Vec<(String, Subject)>> {
    let mut subjects: Vec<(String, Subject)> = Vec::new();
    for algo in &a.algos {
        let choice =
            ferrocomm::plan::parse_choice(algo).map_err(|_| Error::invalid(format!("unknown --algo {algo:?}")))?;
        if choice == Some(Algorithm::Vendor) {
            if !comm.has_vendor_library() {
                if comm.rank() == 0 {
                    println!("# no {algo} rows: the vendor library is not built in or not loaded");
                }
                continue;
            }
            // NCCL through ferrocomm, and NCCL called directly beside it.
            subjects.push((algo.clone(), Subject::Ferro(choice)));
            subjects.push(("nccl-direct".into(), Subject::NcclDirect));
            continue;
        }
        subjects.push((algo.clone(), Subject::Ferro(choice)));
    }
    for q in &a.quantization {
        if let Some(codec) = q.codec(comm.device().facts().backend) {
            let qr = Algorithm::QuickReduce(codec);
            subjects.push((qr.to_string(), Subject::Ferro(Some(qr))));
        }
    }
    subjects.push(("memcpy".into(), Subject::Memcpy));
    Ok(subjects)
}

/// Whether `coll`'s rows on `on` time `subject`: the all-reduce's
/// algorithms apply to it alone; memcpy rows once per size. With
/// `--operands both`, the heap rows leave memcpy and nccl-direct
/// (ferrocomm's route plays no part in them) to the plain rows.
fn applies(a: &Args, coll: Coll, subject: &Subject, on: Operands) -> bool {
    let plain_twin_has_it = a.operands.len() > 1 && on == Operands::Heap;
    match subject {
        Subject::Ferro(choice) => colls::algo_applies(coll, *choice),
        Subject::NcclDirect => !plain_twin_has_it,
        Subject::Memcpy => coll == a.colls[0] && !plain_twin_has_it,
    }
}

/// The rows the sweep will time (for the progress line).
fn rows_total(a: &Args, subjects: &[(String, Subject)]) -> usize {
    let sizes: usize = a.dtypes.iter().map(|&d| a.sizes(d, a.world).count()).sum();
    a.operands
        .iter()
        .flat_map(|&on| a.colls.iter().map(move |&c| (on, c)))
        .map(|(on, c)| {
            let per_size = subjects.iter().filter(|(_, s)| applies(a, c, s, on)).count() * a.modes().len();
            sizes * per_size
        })
        .sum()
}

impl<D: Device> Sweep<'_, D> {
    /// Every row of one collective on one kind of operands.
    fn coll_rows(&self, on: Operands, coll: Coll, heap: Option<&HeapOperands>, rows: &mut Rows) -> Result<()> {
        let a = self.a;
        for &dtype in &a.dtypes {
            if coll.reduces() {
                ferrocomm::dtype::check_supported(dtype, a.op)?;
            }
            for bytes in a.sizes(dtype, a.world) {
                if let Some(case) = case(coll, dtype, bytes, a.world) {
                    self.size_rows(on, &case, heap, rows)?;
                }
            }
        }
        Ok(())
    }

    /// The rows of one size: each subject that applies, in each mode, on
    /// the same inputs (made once).
    fn size_rows(&self, on: Operands, case: &Case, heap: Option<&HeapOperands>, rows: &mut Rows) -> Result<()> {
        let expected = Expected::new(case, self.a, self.comm.rank(), self.a.world)?;
        for (name, subject) in &self.subjects {
            if !applies(self.a, case.coll, subject, on) {
                continue;
            }
            for &mode in self.a.modes() {
                rows.progress.step(&format!(
                    "{} {} {name} {} {mode}",
                    case.coll.name(),
                    human_bytes(case.bytes as f64),
                    on.name()
                ));
                let seq = rows.done.len() + 1;
                let row = self.row(case, (name, *subject), mode, &expected, heap, seq)?;
                rows.push(row, self.comm.rank(), self.a.world);
            }
        }
        Ok(())
    }

    /// One row: measured, judged, and agreed across ranks (the `seq`th).
    fn row(
        &self,
        case: &Case,
        (name, subject): (&str, Subject),
        mode: &'static str,
        expected: &Expected,
        heap: Option<&HeapOperands>,
        seq: usize,
    ) -> Result<Row> {
        let (comm, a) = (self.comm, self.a);
        let (mut row, got) = measure(comm, a, case, subject, mode, &expected.input, heap)?;
        (row.wrong, row.relerr) = judge(comm, a, case, subject, expected, &got)?;
        row.algo = algo_label(comm, a, case, name, subject)?;
        agree(self.store, seq, comm.rank(), a, row)
    }
}

impl Rows {
    /// A row agreed: printed by rank 0 (over its progress line), kept.
    fn push(&mut self, row: Row, rank: usize, world: usize) {
        if rank == 0 {
            self.progress.finish();
            table::print_row(&row, world);
        }
        self.done.push(row);
    }
}

/// The row of `bytes` of `coll`, where they split into whole elements a rank.
fn case(coll: Coll, dtype: DType, bytes: usize, world: usize) -> Option<Case> {
    let (n_in, n_out) = coll.counts(bytes, dtype, world)?;
    Some(Case {
        coll,
        dtype,
        n_in,
        n_out,
        bytes,
    })
}

/// The slowest rank's median time and the sum of wrong elements.
fn agree(store: &Arc<dyn Store>, seq: usize, rank: usize, a: &Args, row: Row) -> Result<Row> {
    let mine = [row.time_us, row.wrong.unwrap_or(0) as f64];
    let all = RankFigures::gather(store, &format!("bench/{seq}"), (rank, a.world), &mine, a.timeout)?;
    Ok(Row {
        time_us: all.max(0),
        wrong: row.wrong.map(|_| all.sum(1)),
        ..row
    })
}

/// Rank 0's progress line on stderr (when the launcher's stderr is a terminal).
struct Progress {
    on: bool,
    done: usize,
    total: usize,
}

impl Progress {
    fn new(rank: usize, total: usize) -> Self {
        let on = rank == 0 && std::env::var("FERROCOMM_BENCH_PROGRESS").as_deref() == Ok("1");
        Progress { on, done: 0, total }
    }

    fn step(&mut self, what: &str) {
        self.done += 1;
        if self.on {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[2K[{}/{}] {what}", self.done, self.total);
            let _ = err.flush();
        }
    }

    fn finish(&self) {
        if self.on {
            eprint!("\r\x1b[2K");
        }
    }
}
