//! The caching pool: plain device allocations kept in a best-fit cache after they are freed, and
//! released back to the driver when the device is idle.
//!
//! Used where the VMM pool is gated off or its probe failed. Requests are rounded (small ones to
//! 512 bytes, large ones to 2 MiB) so that a freed block is likely to fit the next request of a
//! similar size; a cached block serves a request only when it is at most twice the rounded size,
//! so one huge cached block is not pinned by a tiny request.

use std::collections::{BTreeSet, HashMap};

use crate::driver::{DeviceOrdinal, DevicePtr, Driver, DriverError};

const SMALL_ROUNDING: u64 = 512;
const LARGE_ROUNDING: u64 = 2 << 20;
const LARGE_THRESHOLD: u64 = 1 << 20;

/// See the module docs.
#[derive(Debug)]
pub struct CachingPool {
    device: DeviceOrdinal,
    /// Cached (free) blocks ordered by (size, address): best fit is a range query.
    cached: BTreeSet<(u64, u64)>,
    /// Live blocks: address -> size.
    live: HashMap<u64, u64>,
    held: u64,
}

impl CachingPool {
    pub fn new(device: DeviceOrdinal) -> CachingPool {
        CachingPool {
            device,
            cached: BTreeSet::new(),
            live: HashMap::new(),
            held: 0,
        }
    }

    /// The block size a request of `bytes` is served with.
    pub fn rounded(bytes: u64) -> u64 {
        let bytes = bytes.max(1);
        if bytes < LARGE_THRESHOLD {
            bytes.div_ceil(SMALL_ROUNDING) * SMALL_ROUNDING
        } else {
            bytes.div_ceil(LARGE_ROUNDING) * LARGE_ROUNDING
        }
    }

    /// Bytes held from the driver (live plus cached).
    pub fn held_bytes(&self) -> u64 {
        self.held
    }

    pub fn cached_bytes(&self) -> u64 {
        self.cached.iter().map(|&(size, _)| size).sum()
    }

    /// Serves `bytes` from the cache (best fit) or a new driver allocation.
    pub fn alloc(
        &mut self,
        driver: &dyn Driver,
        bytes: u64,
    ) -> Result<(DevicePtr, u64), DriverError> {
        let size = Self::rounded(bytes);
        let best = self
            .cached
            .range((size, 0)..)
            .next()
            .copied()
            .filter(|&(cached, _)| cached <= size.saturating_mul(2));
        if let Some(entry) = best {
            self.cached.remove(&entry);
            self.live.insert(entry.1, entry.0);
            return Ok((DevicePtr(entry.1), entry.0));
        }
        let ptr = driver.alloc(self.device, size)?;
        self.live.insert(ptr.0, size);
        self.held += size;
        Ok((ptr, size))
    }

    /// Puts a block back in the cache.
    pub fn free(&mut self, ptr: DevicePtr) {
        if let Some(size) = self.live.remove(&ptr.0) {
            self.cached.insert((size, ptr.0));
        }
    }

    /// Frees cached blocks, largest first, until at most `floor` bytes are held. The caller must
    /// have synchronised the device. Returns the bytes released.
    pub fn trim(&mut self, driver: &dyn Driver, floor: u64) -> Result<u64, DriverError> {
        let mut released = 0;
        while self.held > floor {
            let Some(&(size, addr)) = self.cached.iter().next_back() else {
                break;
            };
            driver.free(self.device, DevicePtr(addr))?;
            self.cached.remove(&(size, addr));
            self.held -= size;
            released += size;
        }
        Ok(released)
    }

    /// Frees every block, live ones included.
    pub fn destroy(self, driver: &dyn Driver) -> Result<(), DriverError> {
        for &(_, addr) in &self.cached {
            driver.free(self.device, DevicePtr(addr))?;
        }
        for &addr in self.live.keys() {
            driver.free(self.device, DevicePtr(addr))?;
        }
        Ok(())
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use crate::host::{HostDriver, HostDriverConfig};

    const MIB: u64 = 1 << 20;

    #[test]
    fn best_fit_picks_the_smallest_block_that_fits() {
        let driver = HostDriver::new(HostDriverConfig::default());
        let mut pool = CachingPool::new(0);
        let (big, _) = pool.alloc(&driver, 8 * MIB).unwrap();
        let (medium, _) = pool.alloc(&driver, 4 * MIB).unwrap();
        let (small, _) = pool.alloc(&driver, 2 * MIB).unwrap();
        pool.free(big);
        pool.free(medium);
        pool.free(small);
        let (p, size) = pool.alloc(&driver, 3 * MIB).unwrap();
        assert_eq!((p, size), (medium, 4 * MIB));
        let (r, _) = pool.alloc(&driver, 3 * MIB / 2).unwrap();
        assert_eq!(r, small);
        // 8 MiB is more than twice 1.5 MiB rounded (2 MiB): not reused, a new block is made.
        let (q, _) = pool.alloc(&driver, 3 * MIB / 2).unwrap();
        assert_ne!(q, big);
        assert_eq!(pool.held_bytes(), 16 * MIB);
        pool.destroy(&driver).unwrap();
        assert_eq!(driver.used_bytes(), 0);
    }

    #[test]
    fn trim_releases_cached_blocks_down_to_the_floor() {
        let driver = HostDriver::new(HostDriverConfig::default());
        let mut pool = CachingPool::new(0);
        let blocks: Vec<_> = (0..4)
            .map(|_| pool.alloc(&driver, 2 * MIB).unwrap().0)
            .collect();
        for &b in &blocks[1..] {
            pool.free(b);
        }
        assert_eq!(pool.trim(&driver, 4 * MIB).unwrap(), 4 * MIB);
        assert_eq!(pool.held_bytes(), 4 * MIB);
        assert_eq!(
            pool.trim(&driver, 0).unwrap(),
            2 * MIB,
            "the live block stays"
        );
        assert_eq!(driver.used_bytes(), 2 * MIB);
        pool.destroy(&driver).unwrap();
    }
}
