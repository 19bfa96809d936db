//! How an inference job lays its ranks out over the parallel dimensions, and
//! the groups each rank belongs to ([`Communicator::split_by`]).
//!
//! Layout, innermost first: tensor parallel (`tp`), context parallel
//! (`cp`), pipeline parallel (`pp`), data parallel (`dp`):
//!
//! ```text
//! rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank
//! ```
//!
//! so a tensor-parallel group is `tp` consecutive ranks (one node's GPUs
//! when `tp` divides the GPUs per node, which is what the fast intra-node
//! paths want), as in TensorRT-LLM's and FlashInfer's mappings. Expert
//! parallelism spans the tensor- and data-parallel ranks of one pipeline and
//! context slice (`ep = tp * dp`), as vLLM lays experts out when expert
//! parallelism is on.

use super::communicator::Communicator;
use crate::device::Device;
use crate::error::{Error, Result};

/// One parallel dimension of a [`Mapping`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Axis {
    /// Tensor parallel: `tp` consecutive ranks.
    Tp,
    /// Context parallel.
    Cp,
    /// Pipeline parallel.
    Pp,
    /// Data parallel.
    Dp,
    /// Expert parallel: the tp x dp ranks of one (pp, cp) slice.
    Ep,
}

impl Axis {
    /// Every axis.
    pub const ALL: [Axis; 5] = [Axis::Tp, Axis::Cp, Axis::Pp, Axis::Dp, Axis::Ep];

    /// The axis's short name: `tp`, `cp`, `pp`, `dp` or `ep`.
    pub fn name(self) -> &'static str {
        match self {
            Axis::Tp => "tp",
            Axis::Cp => "cp",
            Axis::Pp => "pp",
            Axis::Dp => "dp",
            Axis::Ep => "ep",
        }
    }
}

/// A rank's coordinates in a [`Mapping`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Coords {
    /// Index along the tensor-parallel axis.
    pub tp: usize,
    /// Index along the context-parallel axis.
    pub cp: usize,
    /// Index along the pipeline-parallel axis.
    pub pp: usize,
    /// Index along the data-parallel axis.
    pub dp: usize,
}

/// The sizes of the parallel dimensions of a world (`dp` is what is left).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Mapping {
    /// Tensor-parallel size (ranks `tp` apart differ only in tp).
    pub tp: usize,
    /// Context-parallel size.
    pub cp: usize,
    /// Pipeline-parallel size.
    pub pp: usize,
    /// Data-parallel size: the world divided by the others.
    pub dp: usize,
}

impl Mapping {
    /// `world` ranks as `tp x cp x pp x dp`, `dp = world / (tp * cp * pp)`.
    pub fn new(world: usize, tp: usize, cp: usize, pp: usize) -> Result<Mapping> {
        let inner = tp.checked_mul(cp).and_then(|x| x.checked_mul(pp));
        match inner {
            Some(inner) if tp > 0 && cp > 0 && pp > 0 && world > 0 && world % inner == 0 => Ok(Mapping {
                tp,
                cp,
                pp,
                dp: world / inner,
            }),
            _ => Err(Error::invalid(format!(
                "mapping tp={tp} cp={cp} pp={pp}: their product must be at least 1 and divide the world of {world}"
            ))),
        }
    }

    /// The number of ranks, `tp * cp * pp * dp`.
    pub fn world(&self) -> usize {
        self.tp * self.cp * self.pp * self.dp
    }

    /// The size of `axis`'s groups.
    pub fn size(&self, axis: Axis) -> usize {
        match axis {
            Axis::Tp => self.tp,
            Axis::Cp => self.cp,
            Axis::Pp => self.pp,
            Axis::Dp => self.dp,
            Axis::Ep => self.tp * self.dp,
        }
    }

    /// Where `rank` sits.
    pub fn coords(&self, rank: usize) -> Result<Coords> {
        self.check(rank)?;
        Ok(Coords {
            tp: rank % self.tp,
            cp: rank / self.tp % self.cp,
            pp: rank / (self.tp * self.cp) % self.pp,
            dp: rank / (self.tp * self.cp * self.pp),
        })
    }

    /// The rank at `c` (the inverse of [`Mapping::coords`]).
    pub fn rank_of(&self, c: Coords) -> Result<usize> {
        if c.tp >= self.tp || c.cp >= self.cp || c.pp >= self.pp || c.dp >= self.dp {
            return Err(Error::invalid(format!("coordinates {c:?} lie outside {self:?}")));
        }
        Ok(((c.dp * self.pp + c.pp) * self.cp + c.cp) * self.tp + c.tp)
    }

    /// The ranks of `rank`'s group along `axis`, in the order of the
    /// group's own ranks (a group rank is its index here).
    pub fn group(&self, axis: Axis, rank: usize) -> Result<Vec<usize>> {
        let me = self.coords(rank)?;
        let at = |c: Coords| self.rank_of(c);
        match axis {
            Axis::Tp => (0..self.tp).map(|tp| at(Coords { tp, ..me })).collect(),
            Axis::Cp => (0..self.cp).map(|cp| at(Coords { cp, ..me })).collect(),
            Axis::Pp => (0..self.pp).map(|pp| at(Coords { pp, ..me })).collect(),
            Axis::Dp => (0..self.dp).map(|dp| at(Coords { dp, ..me })).collect(),
            Axis::Ep => (0..self.dp)
                .flat_map(|dp| (0..self.tp).map(move |tp| Coords { tp, dp, ..me }))
                .map(at)
                .collect(),
        }
    }

    fn check(&self, rank: usize) -> Result<()> {
        if rank >= self.world() {
            return Err(Error::invalid(format!(
                "rank {rank} is outside the mapping's world of {}",
                self.world()
            )));
        }
        Ok(())
    }
}

impl<D: Device> Communicator<D> {
    /// This rank's communicator for its group along `axis` of `mapping`.
    /// Collective: every rank of this communicator calls it with the same
    /// mapping and axis; each gets the communicator of its own group (one
    /// split, every group formed at once), named `<name>.<axis><index>`.
    pub fn split_by(&self, mapping: &Mapping, axis: Axis) -> Result<Communicator<D>> {
        if mapping.world() != self.size() {
            return Err(Error::invalid(format!(
                "split_by: the mapping {mapping:?} covers {} ranks, the communicator has {}",
                mapping.world(),
                self.size()
            )));
        }
        let group = mapping.group(axis, self.rank())?;
        // Groups are told apart by their first rank.
        let name = format!("{}.{}{}", self.name(), axis.name(), group[0]);
        self.split(&group, Some(&name))?
            .ok_or_else(|| Error::invalid(format!("split_by: rank {} is not in its own group", self.rank())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coordinates_round_trip_and_tp_is_innermost() {
        let m = Mapping::new(16, 2, 2, 2).unwrap();
        assert_eq!(m.dp, 2);
        for r in 0..16 {
            assert_eq!(m.rank_of(m.coords(r).unwrap()).unwrap(), r);
        }
        assert_eq!(m.group(Axis::Tp, 5).unwrap(), [4, 5]);
        assert_eq!(m.group(Axis::Cp, 5).unwrap(), [5, 7]);
        assert_eq!(m.group(Axis::Pp, 5).unwrap(), [1, 5]);
        assert_eq!(m.group(Axis::Dp, 5).unwrap(), [5, 13]);
        assert_eq!(m.group(Axis::Ep, 5).unwrap(), [4, 5, 12, 13]);
    }

    #[test]
    fn every_axis_partitions_the_world() {
        for (world, tp, cp, pp) in [(8, 4, 1, 2), (12, 2, 3, 1), (6, 1, 1, 1), (24, 2, 2, 3)] {
            let m = Mapping::new(world, tp, cp, pp).unwrap();
            for axis in Axis::ALL {
                let mut seen = vec![0usize; world];
                for r in 0..world {
                    let g = m.group(axis, r).unwrap();
                    assert_eq!(g.len(), m.size(axis), "{m:?} {axis:?}");
                    assert!(g.contains(&r));
                    // Every member names the same group.
                    for &q in &g {
                        assert_eq!(m.group(axis, q).unwrap(), g);
                    }
                    seen[g[0]] += 1;
                }
                let groups = seen.iter().filter(|&&n| n > 0).count();
                assert_eq!(groups * m.size(axis), world, "{m:?} {axis:?}");
            }
        }
    }

    #[test]
    fn sizes_that_do_not_divide_the_world_are_refused() {
        assert!(Mapping::new(6, 4, 1, 1).is_err());
        assert!(Mapping::new(8, 0, 1, 1).is_err());
        assert!(Mapping::new(8, 2, 2, 2).is_ok());
        let m = Mapping::new(4, 2, 1, 1).unwrap();
        assert!(m.coords(4).is_err());
        assert!(m
            .rank_of(Coords {
                tp: 2,
                cp: 0,
                pp: 0,
                dp: 0
            })
            .is_err());
    }
}
