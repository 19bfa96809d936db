//! Which node each rank runs on, and which ranks share a process, gathered
//! once at init.
//!
//! A node is a host, told apart by hostname and boot id (two containers on
//! one host share the boot id and may share the hostname: both must match).
//! `FERROCOMM_LOCAL_SIZE=k` ([`CommOptions::local_size`]) splits the world
//! into pseudo-nodes of k consecutive ranks instead, so multi-node paths can
//! be exercised on one machine; they are still one host, so its memory is
//! shared as usual.

use std::time::Duration;

use super::options::CommOptions;
use crate::bootstrap::{store_all_gather, Store};
use crate::error::{Error, Result};

/// The nodes of a communicator and this rank's place among them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// This rank's node, numbered in order of each node's lowest rank.
    pub node: usize,
    /// How many nodes the communicator spans.
    pub nodes: usize,
    /// This rank's index among its node's ranks.
    pub local_rank: usize,
    /// How many ranks share this rank's node.
    pub local_size: usize,
    /// Whether the nodes are pseudo-nodes of one host (`FERROCOMM_LOCAL_SIZE`).
    pub pseudo: bool,
    node_of: Vec<usize>,
    /// Whether another rank of this rank's node runs in this rank's process
    /// (ranks as threads).
    shares_process: bool,
}

const PSEUDO: &str = "pseudo-node";

impl Topology {
    /// Gather every rank's node. Collective. `root_rank` places the rank in
    /// pseudo-nodes (its rank in the communicator its group was split from).
    pub(crate) fn gather(
        store: &dyn Store,
        prefix: &str,
        rank: usize,
        world: usize,
        root_rank: usize,
        opts: &CommOptions,
        timeout: Duration,
    ) -> Result<Topology> {
        let record = format!("{}\n{}", node_key(root_rank, opts.local_size)?, process_key());
        let records = store_all_gather(
            store,
            &format!("{prefix}/node"),
            rank,
            world,
            record.as_bytes(),
            timeout,
        )?;
        Topology::from_keys(rank, &records)
    }

    /// The topology `rank` sees, given every rank's record: its node key,
    /// then (after a newline, where known) its process key.
    pub(crate) fn from_keys(rank: usize, records: &[Vec<u8>]) -> Result<Topology> {
        let split = |r: &Vec<u8>| match r.iter().position(|&b| b == b'\n') {
            Some(i) => (r[..i].to_vec(), Some(r[i + 1..].to_vec())),
            None => (r.clone(), None),
        };
        let (keys, processes): (Vec<Vec<u8>>, Vec<Option<Vec<u8>>>) = records.iter().map(split).unzip();
        let pseudo = |k: &Vec<u8>| k.starts_with(PSEUDO.as_bytes());
        let size_of = |k: &Vec<u8>| k.split(|&b| b == b'/').nth(1).map(<[u8]>::to_vec);
        if keys.iter().any(pseudo) {
            let first = size_of(&keys[0]);
            if let Some(r) = keys.iter().position(|k| !pseudo(k) || size_of(k) != first) {
                return Err(Error::Mismatch {
                    rank,
                    peer: r,
                    detail: "FERROCOMM_LOCAL_SIZE differs between ranks (every rank must set the same value)".into(),
                });
            }
        }
        let mut distinct: Vec<&Vec<u8>> = Vec::new();
        let node_of: Vec<usize> = keys
            .iter()
            .map(|k| match distinct.iter().position(|d| *d == k) {
                Some(i) => i,
                None => {
                    distinct.push(k);
                    distinct.len() - 1
                }
            })
            .collect();
        let node = node_of[rank];
        let shares_process = processes[rank].is_some()
            && (0..keys.len()).any(|r| r != rank && node_of[r] == node && processes[r] == processes[rank]);
        Ok(Topology {
            node,
            nodes: distinct.len(),
            local_rank: node_of[..rank].iter().filter(|&&n| n == node).count(),
            local_size: node_of.iter().filter(|&&n| n == node).count(),
            pseudo: keys.first().is_some_and(pseudo),
            node_of,
            shares_process,
        })
    }

    /// Whether another rank of this rank's node is a thread of this rank's
    /// process (they then share the vendor driver's process-wide locks).
    pub fn shares_process(&self) -> bool {
        self.shares_process
    }

    /// The node of `rank`.
    pub fn node_of(&self, rank: usize) -> Option<usize> {
        self.node_of.get(rank).copied()
    }

    /// The ranks on `node`, in order.
    pub fn ranks_on(&self, node: usize) -> Vec<usize> {
        (0..self.node_of.len()).filter(|&r| self.node_of[r] == node).collect()
    }

    /// "1 node" or "2 nodes (2+2 ranks)", "pseudo-nodes" when simulated.
    pub fn describe(&self) -> String {
        if self.nodes == 1 {
            return "1 node".into();
        }
        let sizes: Vec<String> = (0..self.nodes).map(|n| self.ranks_on(n).len().to_string()).collect();
        let what = if self.pseudo { "pseudo-nodes" } else { "nodes" };
        format!("{} {what} ({} ranks)", self.nodes, sizes.join("+"))
    }
}

/// This rank's node key: `pseudo-node/<k>/<index>`, or the host's name and
/// boot id.
fn node_key(rank: usize, local_size: Option<usize>) -> Result<String> {
    if let Some(k) = local_size {
        return Ok(format!("{PSEUDO}/{k}/{}", rank / k));
    }
    Ok(host_key())
}

/// The host's name and boot id.
fn host_key() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("host/{}/{}", hostname(), boot.trim())
}

/// This process: its host and its id.
fn process_key() -> String {
    format!("{}/{}", host_key(), std::process::id())
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into `buf`.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    if r != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(k: &[&str]) -> Vec<Vec<u8>> {
        k.iter().map(|s| s.as_bytes().to_vec()).collect()
    }

    #[test]
    fn nodes_are_numbered_by_their_lowest_rank() {
        let k = keys(&["host/b/1", "host/a/1", "host/b/1", "host/a/1", "host/c/1"]);
        let t = Topology::from_keys(3, &k).unwrap();
        assert_eq!((t.node, t.nodes, t.local_rank, t.local_size), (1, 3, 1, 2));
        assert_eq!(t.ranks_on(0), [0, 2]);
        assert_eq!(t.node_of(4), Some(2));
        assert_eq!(t.describe(), "3 nodes (2+2+1 ranks)");
        // Same hostname, another boot: another node.
        let t = Topology::from_keys(0, &keys(&["host/a/1", "host/a/2"])).unwrap();
        assert_eq!(t.nodes, 2);
    }

    #[test]
    fn pseudo_nodes_split_consecutive_ranks() {
        let k: Vec<Vec<u8>> = (0..12).map(|r| node_key(r, Some(4)).unwrap().into_bytes()).collect();
        let t = Topology::from_keys(9, &k).unwrap();
        assert_eq!(
            (t.node, t.nodes, t.local_rank, t.local_size, t.pseudo),
            (2, 3, 1, 4, true)
        );
        assert_eq!(t.describe(), "3 pseudo-nodes (4+4+4 ranks)");
    }

    #[test]
    fn ranks_that_disagree_on_the_local_size_are_a_mismatch() {
        let mut k: Vec<Vec<u8>> = (0..4).map(|r| node_key(r, Some(2)).unwrap().into_bytes()).collect();
        k[3] = node_key(3, Some(4)).unwrap().into_bytes();
        assert!(matches!(
            Topology::from_keys(0, &k),
            Err(Error::Mismatch { peer: 3, .. })
        ));
        k[3] = node_key(3, None).unwrap().into_bytes();
        assert!(matches!(
            Topology::from_keys(0, &k),
            Err(Error::Mismatch { peer: 3, .. })
        ));
    }

    #[test]
    fn ranks_of_one_process_on_one_node_share_it() {
        let k = keys(&["host/a/1\np/7", "host/a/1\np/7", "host/a/1\np/8", "host/b/1\np/8"]);
        let shares = |rank| Topology::from_keys(rank, &k).unwrap().shares_process();
        assert_eq!([shares(0), shares(1), shares(2), shares(3)], [true, true, false, false]);
        // Without process keys, nothing is shared.
        let k = keys(&["host/a/1", "host/a/1"]);
        assert!(!Topology::from_keys(0, &k).unwrap().shares_process());
        assert_eq!(Topology::from_keys(0, &k).unwrap().nodes, 1);
    }

    #[test]
    fn this_host_has_a_key() {
        let k = node_key(0, None).unwrap();
        assert!(k.starts_with("host/"));
        let k = keys(&[&k, &k, &k]);
        let t = Topology::from_keys(1, &k).unwrap();
        assert_eq!((t.node, t.nodes, t.local_rank, t.local_size), (0, 1, 1, 3));
        assert_eq!(t.describe(), "1 node");
    }
}
