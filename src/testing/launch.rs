//! Launching ranks as processes: the launcher hosts the TCP store and starts
//! `world` copies of a worker binary, then collects what each printed.
//! Nothing here can hang: past the deadline every child is killed.

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::bootstrap::{TcpStoreConfig, TcpStoreServer};
use crate::error::{Error, Result};

/// What one rank process did.
#[derive(Debug)]
pub struct RankOutput {
    pub rank: usize,
    /// Exit code; `None` if killed by a signal (or by the launcher's deadline).
    pub code: Option<i32>,
    pub timed_out: bool,
    pub stdout: String,
    pub stderr: String,
}

/// A random hex token for a job's store.
pub fn random_token() -> Result<String> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| Error::io("reading /dev/urandom for a store token", e))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Where a drained pipe's bytes go besides the collected string.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Echo {
    None,
    Stdout,
    Stderr,
}

fn drain(mut pipe: impl Read + Send + 'static, echo: Echo) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut all = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match pipe.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    // Echoed as it arrives, so a long run shows its rows (and
                    // progress) as they are measured, not at the end.
                    let _ = match echo {
                        Echo::None => Ok(()),
                        Echo::Stdout => std::io::stdout().lock().write_all(&buf[..n]),
                        Echo::Stderr => std::io::stderr().lock().write_all(&buf[..n]),
                    };
                    all.extend_from_slice(&buf[..n]);
                }
            }
        }
        String::from_utf8_lossy(&all).into_owned()
    })
}

/// Start `world` processes of `exe args...`, one per rank, sharing a store
/// this process hosts, and wait (at most `timeout`) for all of them.
pub fn run_process_ranks(
    exe: &Path,
    args: &[&str],
    world: usize,
    envs: &[(&str, &str)],
    timeout: Duration,
) -> Result<Vec<RankOutput>> {
    run_ranks(exe, args, world, envs, timeout, false)
}

/// [`run_process_ranks`], with rank 0's stdout and stderr also passed through
/// to ours as they arrive (they are still collected).
pub fn run_process_ranks_echo(
    exe: &Path,
    args: &[&str],
    world: usize,
    envs: &[(&str, &str)],
    timeout: Duration,
) -> Result<Vec<RankOutput>> {
    run_ranks(exe, args, world, envs, timeout, true)
}

fn run_ranks(
    exe: &Path,
    args: &[&str],
    world: usize,
    envs: &[(&str, &str)],
    timeout: Duration,
    echo_rank0: bool,
) -> Result<Vec<RankOutput>> {
    let token = random_token()?;
    let server = TcpStoreServer::start(TcpStoreConfig::new(token.as_bytes().to_vec()))?;
    let addr = server.connect_addr().to_string();
    let mut children: Vec<(Child, JoinHandle<String>, JoinHandle<String>)> = Vec::new();
    for rank in 0..world {
        let mut cmd = Command::new(exe);
        cmd.args(args)
            .env("FERROCOMM_STORE_ADDR", &addr)
            .env("FERROCOMM_TOKEN", &token)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                for (mut c, ..) in children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(Error::io(format!("starting rank {rank}: {}", exe.display()), e));
            }
        };
        let (echo_out, echo_err) = match echo_rank0 && rank == 0 {
            true => (Echo::Stdout, Echo::Stderr),
            false => (Echo::None, Echo::None),
        };
        let out = drain(child.stdout.take().expect("stdout is piped"), echo_out);
        let err = drain(child.stderr.take().expect("stderr is piped"), echo_err);
        children.push((child, out, err));
    }
    let deadline = Instant::now() + timeout;
    let mut codes: Vec<Option<Option<i32>>> = vec![None; world];
    let mut timed_out = vec![false; world];
    while codes.iter().any(Option::is_none) {
        for (rank, (child, ..)) in children.iter_mut().enumerate() {
            if codes[rank].is_none() {
                if let Ok(Some(status)) = child.try_wait() {
                    codes[rank] = Some(status.code());
                }
            }
        }
        if Instant::now() > deadline {
            for (rank, (child, ..)) in children.iter_mut().enumerate() {
                if codes[rank].is_none() {
                    let _ = child.kill();
                    let _ = child.wait();
                    codes[rank] = Some(None);
                    timed_out[rank] = true;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(server);
    Ok(children
        .into_iter()
        .enumerate()
        .map(|(rank, (_, out, err))| RankOutput {
            rank,
            code: codes[rank].flatten(),
            timed_out: timed_out[rank],
            stdout: out.join().unwrap_or_default(),
            stderr: err.join().unwrap_or_default(),
        })
        .collect())
}

/// Panic (with every rank's output) unless every rank exited 0 and printed
/// `RESULT ok`. For tests; echoes each rank's stdout to stderr either way.
pub fn assert_all_ok(outs: &[RankOutput]) {
    for o in outs {
        eprint!("rank {}: {}", o.rank, o.stdout);
        assert!(
            o.code == Some(0) && o.stdout.contains("RESULT ok"),
            "rank {} failed (code {:?}, timed out {}):\n{}\n{}",
            o.rank,
            o.code,
            o.timed_out,
            o.stdout,
            o.stderr
        );
    }
}

/// Panic unless `victim` died by a signal and every other rank reported the
/// failure (exit 0, no hang).
pub fn assert_victim_killed(outs: &[RankOutput], victim: usize) {
    for o in outs {
        eprint!("rank {}: {}", o.rank, o.stdout);
        if o.rank == victim {
            assert_eq!(o.code, None, "the victim should have died by SIGKILL: {}", o.stdout);
            assert!(!o.timed_out, "the victim should have killed itself");
        } else {
            assert!(!o.timed_out, "rank {} hung", o.rank);
            assert_eq!(o.code, Some(0), "rank {}: {}\n{}", o.rank, o.stdout, o.stderr);
            assert!(
                o.stdout.contains(&format!("[{victim}]")),
                "rank {} did not name the victim: {}",
                o.rank,
                o.stdout
            );
        }
    }
}

/// The GPU a rank opens: its local rank, or with `FERROCOMM_TEST_SHARE_GPU=1`
/// that modulo the GPUs there are, so that a one-GPU machine runs the
/// multi-process protocols (processes time-slice the GPU; no performance
/// meaning). Shared ranks need `FERROCOMM_CCL=0`: NCCL refuses two ranks on
/// one GPU.
#[cfg(feature = "cuda")]
pub fn cuda_index(local: usize) -> Result<usize> {
    if std::env::var("FERROCOMM_TEST_SHARE_GPU").as_deref() != Ok("1") {
        return Ok(local);
    }
    Ok(local % crate::backends::cuda::device_count()?.max(1))
}
