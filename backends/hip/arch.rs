//! Which `gfx` target a device is, without `hipDeviceProp_t::gcnArchName`
//! (the struct's layout changed in ROCm 6.0, and `hipDeviceGetAttribute` has
//! no string attribute). In order:
//!
//! 1. `FERROCOMM_HIP_ARCH` (for example `gfx942`), for every device;
//! 2. the kernel driver's topology, `/sys/class/kfd/kfd/topology/nodes/*/properties`:
//!    the node whose PCI domain, bus and device match the HIP device's
//!    attributes gives `gfx_target_version` (major * 10000 + minor * 100 +
//!    stepping, e.g. 90402 = gfx942), a stable kernel ABI that ROCm itself
//!    reads;
//! 3. HIP's compute capability, which is (gfx major, gfx minor) without the
//!    stepping: (9, 4) = gfx942 and (9, 5) = gfx950 are unambiguous; (9, 0)
//!    is taken as gfx90a (MI200), the only CDNA 2 part.
//!
//! The arch is the plain processor name: code objects built for it carry
//! "any" xnack and sramecc settings, so they load in every mode.

use std::path::Path;

/// Where the arch came from (printed in errors and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ArchSource {
    Env,
    Kfd,
    ComputeCapability,
}

/// `gfx942` from KFD's `gfx_target_version` 90402 (stepping in hex: 90010 = gfx90a).
pub(super) fn gfx_from_target_version(v: u32) -> Option<String> {
    if v == 0 {
        return None;
    }
    let (major, minor, stepping) = (v / 10_000, (v / 100) % 100, v % 100);
    if major == 0 || minor > 15 || stepping > 15 {
        return None;
    }
    Some(format!("gfx{major}{minor:x}{stepping:x}"))
}

/// Best guess from HIP's compute capability `(major, minor)`.
pub(super) fn gfx_from_compute_capability(major: i32, minor: i32) -> Option<String> {
    let name = match (major, minor) {
        (9, 0) => "gfx90a",
        (9, 4) => "gfx942",
        (9, 5) => "gfx950",
        (10, 3) => "gfx1030",
        (11, 0) => "gfx1100",
        (12, 0) => "gfx1200",
        _ => return None,
    };
    Some(name.to_string())
}

/// The value of `key` in a KFD `properties` file (`key value` lines).
fn property(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        (it.next() == Some(key)).then(|| it.next()?.parse().ok())?
    })
}

/// The `gfx_target_version` of the KFD node at PCI `domain:bus:device`.
pub(super) fn kfd_target_version(root: &Path, domain: u32, bus: u32, device: u32) -> Option<u32> {
    let nodes = std::fs::read_dir(root).ok()?;
    for node in nodes.flatten() {
        let Ok(text) = std::fs::read_to_string(node.path().join("properties")) else {
            continue;
        };
        let Some(version) = property(&text, "gfx_target_version").filter(|&v| v != 0) else {
            continue; // CPU nodes
        };
        // location_id = bus << 8 | device << 3 | function.
        let Some(location) = property(&text, "location_id") else {
            continue;
        };
        let node_domain = property(&text, "domain").unwrap_or(0);
        if node_domain == u64::from(domain)
            && (location >> 8) & 0xff == u64::from(bus)
            && (location >> 3) & 0x1f == u64::from(device)
        {
            return u32::try_from(version).ok();
        }
    }
    None
}

/// The device's arch and where it came from, or why it cannot be told.
pub(super) fn resolve(
    kfd_root: &Path,
    pci: Option<(u32, u32, u32)>,
    cc: (i32, i32),
) -> Result<(String, ArchSource), String> {
    if let Ok(v) = std::env::var("FERROCOMM_HIP_ARCH") {
        let v = v.trim();
        let base = v.split(':').next().unwrap_or("");
        if base.len() > 3 && base.starts_with("gfx") && base[3..].bytes().all(|c| c.is_ascii_alphanumeric()) {
            return Ok((base.to_string(), ArchSource::Env));
        }
        return Err(format!(
            "FERROCOMM_HIP_ARCH={v:?} is not a gfx target name such as gfx942"
        ));
    }
    if let Some((domain, bus, device)) = pci {
        if let Some(name) = kfd_target_version(kfd_root, domain, bus, device).and_then(gfx_from_target_version) {
            return Ok((name, ArchSource::Kfd));
        }
    }
    gfx_from_compute_capability(cc.0, cc.1)
        .map(|n| (n, ArchSource::ComputeCapability))
        .ok_or_else(|| {
            format!(
                "cannot tell the gfx target of a device with compute capability {}.{} (no matching KFD topology \
                 node under {}); set FERROCOMM_HIP_ARCH, e.g. FERROCOMM_HIP_ARCH=gfx942",
                cc.0,
                cc.1,
                kfd_root.display()
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_versions_name_their_arch() {
        assert_eq!(gfx_from_target_version(90402).as_deref(), Some("gfx942"));
        assert_eq!(gfx_from_target_version(90500).as_deref(), Some("gfx950"));
        assert_eq!(gfx_from_target_version(90010).as_deref(), Some("gfx90a"));
        assert_eq!(gfx_from_target_version(90008).as_deref(), Some("gfx908"));
        assert_eq!(gfx_from_target_version(110000).as_deref(), Some("gfx1100"));
        assert_eq!(gfx_from_target_version(100300).as_deref(), Some("gfx1030"));
        assert_eq!(gfx_from_target_version(0), None);
    }

    #[test]
    fn compute_capability_fallback() {
        assert_eq!(gfx_from_compute_capability(9, 4).as_deref(), Some("gfx942"));
        assert_eq!(gfx_from_compute_capability(9, 5).as_deref(), Some("gfx950"));
        assert_eq!(gfx_from_compute_capability(8, 0), None);
    }

    #[test]
    fn kfd_topology_is_matched_by_pci_address() {
        let root = std::env::temp_dir().join(format!("ferrocomm-kfd-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let node = |i: usize, text: &str| {
            let d = root.join(i.to_string());
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("properties"), text).unwrap();
        };
        node(0, "cpu_cores_count 64\ngfx_target_version 0\nlocation_id 0\ndomain 0\n");
        // bus 0x0c, device 0, function 0 -> location_id 0x0c00 = 3072.
        node(
            1,
            "simd_count 1216\ngfx_target_version 90402\nlocation_id 3072\ndomain 0\n",
        );
        // bus 0x22, device 1, function 0 -> (0x22 << 8) | (1 << 3) = 8712.
        node(2, "gfx_target_version 90010\nlocation_id 8712\ndomain 1\n");
        assert_eq!(kfd_target_version(&root, 0, 0x0c, 0), Some(90402));
        assert_eq!(kfd_target_version(&root, 1, 0x22, 1), Some(90010));
        assert_eq!(kfd_target_version(&root, 0, 0x22, 1), None, "domain must match");
        assert_eq!(kfd_target_version(&root, 0, 0x0d, 0), None);
        if std::env::var_os("FERROCOMM_HIP_ARCH").is_none() {
            assert_eq!(
                resolve(&root, Some((0, 0x0c, 0)), (9, 0)).unwrap(),
                ("gfx942".to_string(), ArchSource::Kfd)
            );
            assert_eq!(
                resolve(&root, Some((0, 0x0d, 0)), (9, 5)).unwrap(),
                ("gfx950".to_string(), ArchSource::ComputeCapability)
            );
            assert!(resolve(&root, None, (8, 0)).unwrap_err().contains("FERROCOMM_HIP_ARCH"));
        }
        let _ = std::fs::remove_dir_all(&root);
    }
}
