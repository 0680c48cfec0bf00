//! The VMM pool: one large virtual reservation per device, physical memory mapped in fixed-size
//! chunks on demand and unmapped again when idle.
//!
//! Allocations take the lowest free virtual range that fits (first fit by address), so live
//! memory stays packed at the bottom of the reservation and whatever the last burst used above it
//! can be unmapped as whole chunks. Chunks are aligned to the chunk size relative to the base, so
//! a chunk is mapped exactly once however many allocations share it, and each chunk counts the
//! live allocations that overlap it: a chunk with none can be unmapped. The idea is the CUDA/HIP
//! "expandable segments" approach, with the difference that this pool also shrinks.

use std::collections::BTreeMap;

use crate::driver::{DeviceOrdinal, DevicePtr, Driver, DriverError, PhysicalHandle};

/// Allocations are aligned to this many bytes inside the reservation.
pub const VMM_ALIGNMENT: u64 = 256;

#[derive(Debug)]
struct Chunk {
    handle: PhysicalHandle,
    live: u32,
}

/// See the module docs.
#[derive(Debug)]
pub struct VmmPool {
    device: DeviceOrdinal,
    base: DevicePtr,
    reserved: u64,
    chunk_bytes: u64,
    /// Free virtual ranges: offset -> length, coalesced.
    free: BTreeMap<u64, u64>,
    /// Mapped chunks by index.
    chunks: BTreeMap<u64, Chunk>,
}

impl VmmPool {
    /// Reserves `reserve_bytes` of virtual space (rounded up to whole chunks); `chunk_bytes` is
    /// rounded up to the device granularity.
    pub fn new(
        driver: &dyn Driver,
        device: DeviceOrdinal,
        reserve_bytes: u64,
        chunk_bytes: u64,
    ) -> Result<VmmPool, DriverError> {
        let granularity = driver.vmm_granularity(device)?.max(1);
        let chunk_bytes = chunk_bytes.max(granularity).div_ceil(granularity) * granularity;
        let reserved = reserve_bytes.max(chunk_bytes).div_ceil(chunk_bytes) * chunk_bytes;
        let base = driver.vmm_reserve(device, reserved)?;
        let mut free = BTreeMap::new();
        free.insert(0, reserved);
        Ok(VmmPool {
            device,
            base,
            reserved,
            chunk_bytes,
            free,
            chunks: BTreeMap::new(),
        })
    }

    pub fn base(&self) -> DevicePtr {
        self.base
    }

    pub fn reserved_bytes(&self) -> u64 {
        self.reserved
    }

    pub fn chunk_bytes(&self) -> u64 {
        self.chunk_bytes
    }

    /// Physical memory currently mapped.
    pub fn mapped_bytes(&self) -> u64 {
        self.chunks.len() as u64 * self.chunk_bytes
    }

    /// The rounded size an allocation of `bytes` occupies.
    pub fn rounded(bytes: u64) -> u64 {
        bytes.max(1).div_ceil(VMM_ALIGNMENT) * VMM_ALIGNMENT
    }

    /// Allocates `bytes`, mapping chunks as needed. Returns the pointer and the occupied size.
    pub fn alloc(
        &mut self,
        driver: &dyn Driver,
        bytes: u64,
    ) -> Result<(DevicePtr, u64), DriverError> {
        let size = Self::rounded(bytes);
        let Some((&offset, &length)) = self.free.iter().find(|(_, &length)| length >= size) else {
            return Err(DriverError::OutOfMemory {
                call: "VMM pool reservation",
                bytes,
            });
        };
        self.free.remove(&offset);
        if length > size {
            self.free.insert(offset + size, length - size);
        }
        if let Err(error) = self.map_range(driver, offset, size) {
            self.insert_free(offset, size);
            return Err(error);
        }
        Ok((self.base.offset(offset), size))
    }

    /// Returns an allocation made by [`VmmPool::alloc`]. The memory stays mapped until a trim.
    pub fn free(&mut self, ptr: DevicePtr, size: u64) {
        let offset = ptr.0 - self.base.0;
        for index in self.chunk_range(offset, size) {
            if let Some(chunk) = self.chunks.get_mut(&index) {
                chunk.live = chunk.live.saturating_sub(1);
            }
        }
        self.insert_free(offset, size);
    }

    /// Unmaps chunks with no live allocation, highest first, until at most `floor` bytes stay
    /// mapped. The caller must have synchronised the device: unmapping memory a queued kernel
    /// still uses would fault. Returns the bytes unmapped.
    pub fn trim(&mut self, driver: &dyn Driver, floor: u64) -> Result<u64, DriverError> {
        let mut released = 0;
        let idle: Vec<u64> = self
            .chunks
            .iter()
            .rev()
            .filter(|(_, c)| c.live == 0)
            .map(|(&i, _)| i)
            .collect();
        for index in idle {
            if self.mapped_bytes() <= floor {
                break;
            }
            self.unmap_chunk(driver, index)?;
            released += self.chunk_bytes;
        }
        Ok(released)
    }

    /// Unmaps everything and returns the reservation. Live allocations become invalid.
    pub fn destroy(mut self, driver: &dyn Driver) -> Result<(), DriverError> {
        let all: Vec<u64> = self.chunks.keys().copied().collect();
        for index in all {
            self.unmap_chunk(driver, index)?;
        }
        driver.vmm_free_reserved(self.device, self.base, self.reserved)
    }

    fn chunk_range(&self, offset: u64, size: u64) -> std::ops::Range<u64> {
        offset / self.chunk_bytes..(offset + size).div_ceil(self.chunk_bytes)
    }

    fn map_range(
        &mut self,
        driver: &dyn Driver,
        offset: u64,
        size: u64,
    ) -> Result<(), DriverError> {
        let mut newly_mapped = Vec::new();
        for index in self.chunk_range(offset, size) {
            if self.chunks.contains_key(&index) {
                continue;
            }
            match self.map_chunk(driver, index) {
                Ok(()) => newly_mapped.push(index),
                Err(error) => {
                    for index in newly_mapped {
                        // Best effort: the chunk was mapped by this call and holds nothing.
                        if let Err(unmap_error) = self.unmap_chunk(driver, index) {
                            tracing::warn!(%unmap_error, "VMM pool could not roll back a chunk mapping");
                        }
                    }
                    return Err(error);
                }
            }
        }
        for index in self.chunk_range(offset, size) {
            if let Some(chunk) = self.chunks.get_mut(&index) {
                chunk.live += 1;
            }
        }
        Ok(())
    }

    fn map_chunk(&mut self, driver: &dyn Driver, index: u64) -> Result<(), DriverError> {
        let ptr = self.base.offset(index * self.chunk_bytes);
        let handle = driver.vmm_create(self.device, self.chunk_bytes)?;
        if let Err(error) = driver.vmm_map(self.device, ptr, self.chunk_bytes, handle) {
            let _ = driver.vmm_release(self.device, handle);
            return Err(error);
        }
        if let Err(error) = driver.vmm_set_access(self.device, ptr, self.chunk_bytes) {
            let _ = driver.vmm_unmap(self.device, ptr, self.chunk_bytes);
            let _ = driver.vmm_release(self.device, handle);
            return Err(error);
        }
        self.chunks.insert(index, Chunk { handle, live: 0 });
        Ok(())
    }

    fn unmap_chunk(&mut self, driver: &dyn Driver, index: u64) -> Result<(), DriverError> {
        let Some(chunk) = self.chunks.get(&index) else {
            return Ok(());
        };
        let ptr = self.base.offset(index * self.chunk_bytes);
        driver.vmm_unmap(self.device, ptr, self.chunk_bytes)?;
        let handle = chunk.handle;
        self.chunks.remove(&index);
        driver.vmm_release(self.device, handle)
    }

    fn insert_free(&mut self, mut offset: u64, mut size: u64) {
        if let Some((&prev, &prev_len)) = self.free.range(..offset).next_back() {
            if prev + prev_len == offset {
                self.free.remove(&prev);
                offset = prev;
                size += prev_len;
            }
        }
        if let Some(&next_len) = self.free.get(&(offset + size)) {
            self.free.remove(&(offset + size));
            size += next_len;
        }
        self.free.insert(offset, size);
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use crate::host::{HostDriver, HostDriverConfig};

    const MIB: u64 = 1 << 20;

    #[test]
    fn chunks_are_shared_and_unmapped_only_when_empty() {
        let driver = HostDriver::new(HostDriverConfig::default());
        let mut pool = VmmPool::new(&driver, 0, 64 * MIB, 4 * MIB).unwrap();
        let (a, a_size) = pool.alloc(&driver, MIB).unwrap();
        let (b, b_size) = pool.alloc(&driver, MIB).unwrap();
        assert_eq!(a, pool.base());
        assert_eq!(b, pool.base().offset(MIB));
        assert_eq!(pool.mapped_bytes(), 4 * MIB);
        // A 6 MiB allocation starting at 2 MiB spans chunks 0 and 1 and maps chunk 1 only.
        let (c, c_size) = pool.alloc(&driver, 6 * MIB).unwrap();
        assert_eq!(pool.mapped_bytes(), 8 * MIB);
        pool.free(c, c_size);
        assert_eq!(pool.trim(&driver, 0).unwrap(), 4 * MIB);
        assert_eq!(pool.mapped_bytes(), 4 * MIB);
        pool.free(a, a_size);
        assert_eq!(pool.trim(&driver, 0).unwrap(), 0, "chunk 0 still holds b");
        pool.free(b, b_size);
        assert_eq!(pool.trim(&driver, 0).unwrap(), 4 * MIB);
        assert_eq!(driver.used_bytes(), 0);
        pool.destroy(&driver).unwrap();
    }

    #[test]
    fn freed_ranges_coalesce_and_are_reused_lowest_first() {
        let driver = HostDriver::new(HostDriverConfig::default());
        let mut pool = VmmPool::new(&driver, 0, 64 * MIB, 2 * MIB).unwrap();
        let blocks: Vec<_> = (0..4).map(|_| pool.alloc(&driver, MIB).unwrap()).collect();
        pool.free(blocks[1].0, blocks[1].1);
        pool.free(blocks[2].0, blocks[2].1);
        let (p, _) = pool.alloc(&driver, 2 * MIB).unwrap();
        assert_eq!(
            p, blocks[1].0,
            "two adjacent freed ranges serve one larger request"
        );
        pool.destroy(&driver).unwrap();
    }

    #[test]
    fn failed_mapping_leaves_the_pool_consistent() {
        let driver = HostDriver::new(HostDriverConfig {
            total_memory: 8 * MIB,
            ..HostDriverConfig::default()
        });
        let mut pool = VmmPool::new(&driver, 0, 64 * MIB, 2 * MIB).unwrap();
        let (a, _) = pool.alloc(&driver, 4 * MIB).unwrap();
        let error = pool.alloc(&driver, 6 * MIB).unwrap_err();
        assert!(error.is_out_of_memory(), "{error}");
        assert_eq!(
            pool.mapped_bytes(),
            4 * MIB,
            "the failed request's chunks were rolled back"
        );
        let (b, _) = pool.alloc(&driver, 4 * MIB).unwrap();
        assert_eq!(b, a.offset(4 * MIB));
        pool.destroy(&driver).unwrap();
    }
}
