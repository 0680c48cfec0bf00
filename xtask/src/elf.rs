//! Code-object verification: reads the ELF header of a compiled kernel and says which GPU it is
//! for, so a build never ships an object for the wrong architecture (or a clang offload bundle
//! where the loader expects a bare ELF).
//!
//! AMDGPU: `e_machine` is EM_AMDGPU (224), OS/ABI is AMDGPU_HSA (64), and the processor sits in the
//! low byte of `e_flags` (EF_AMDGPU_MACH, values from LLVM's AMDGPUUsage table). CUDA cubins:
//! `e_machine` is EM_CUDA (190); the SM number is the low byte of `e_flags` for ELF ABI version 7
//! and bits 8..16 from ABI version 8 on (the Blackwell-era layout).

use std::fmt;

pub const EM_AMDGPU: u16 = 224;
pub const EM_CUDA: u16 = 190;
pub const ELFOSABI_AMDGPU_HSA: u8 = 64;
const EF_AMDGPU_MACH: u32 = 0xff;
/// The CUDA ELF ABI version whose `e_flags` keep the SM number in the low byte.
const ELFABIVERSION_CUDA_V1: u8 = 7;

/// EF_AMDGPU_MACH values of the processors ember targets (LLVM AMDGPUUsage, "AMDGPU ELF Header").
const AMDGPU_MACH: &[(&str, u32)] = &[
    ("gfx900", 0x02c),
    ("gfx906", 0x02f),
    ("gfx908", 0x030),
    ("gfx90a", 0x03f),
    ("gfx940", 0x040),
    ("gfx942", 0x04c),
    ("gfx950", 0x04f),
    ("gfx1010", 0x033),
    ("gfx1030", 0x036),
    ("gfx1031", 0x037),
    ("gfx1032", 0x038),
    ("gfx1033", 0x039),
    ("gfx1034", 0x03e),
    ("gfx1035", 0x03d),
    ("gfx1036", 0x045),
    ("gfx1100", 0x041),
    ("gfx1101", 0x046),
    ("gfx1102", 0x047),
    ("gfx1103", 0x044),
    ("gfx1150", 0x043),
    ("gfx1151", 0x04a),
    ("gfx1152", 0x055),
    ("gfx1153", 0x058),
    ("gfx1200", 0x048),
    ("gfx1201", 0x04e),
];

/// The architecture a code object was compiled for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CodeObjectArch {
    /// `gfx1201`, or `unknown EF_AMDGPU_MACH 0x..` for a processor missing from the table.
    Amdgpu(String),
    /// `sm_90`.
    Cuda(String),
}

impl fmt::Display for CodeObjectArch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CodeObjectArch::Amdgpu(name) | CodeObjectArch::Cuda(name) => f.write_str(name),
        }
    }
}

/// Why a file is not a code object for the expected target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ElfError {
    TooShort {
        len: usize,
    },
    NotElf {
        found: [u8; 4],
    },
    OffloadBundle,
    Not64BitLittleEndian {
        class: u8,
        data: u8,
    },
    UnknownMachine {
        machine: u16,
    },
    WrongOsAbi {
        os_abi: u8,
    },
    WrongArch {
        expected: String,
        found: CodeObjectArch,
    },
}

impl fmt::Display for ElfError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ElfError::TooShort { len } => {
                write!(f, "expected an ELF header of 64 bytes, found a file of {len} bytes")
            }
            ElfError::NotElf { found } => {
                let found: Vec<String> = found.iter().map(|b| format!("{b:02x}")).collect();
                write!(f, "expected the ELF magic 7f 45 4c 46, found {}", found.join(" "))
            }
            ElfError::OffloadBundle => f.write_str(
                "expected a bare ELF code object, found a clang offload bundle (compile with --no-gpu-bundle-output)",
            ),
            ElfError::Not64BitLittleEndian { class, data } => write!(
                f,
                "expected a 64-bit little-endian ELF (class 2, data 1), found class {class}, data {data}"
            ),
            ElfError::UnknownMachine { machine } => write!(
                f,
                "expected e_machine EM_AMDGPU ({EM_AMDGPU}) or EM_CUDA ({EM_CUDA}), found {machine}"
            ),
            ElfError::WrongOsAbi { os_abi } => write!(
                f,
                "expected OS/ABI AMDGPU_HSA ({ELFOSABI_AMDGPU_HSA}) in an AMDGPU code object, found {os_abi}"
            ),
            ElfError::WrongArch { expected, found } => {
                write!(f, "expected a code object for {expected}, found one for {found}")
            }
        }
    }
}

impl std::error::Error for ElfError {}

/// Reads the architecture from a code object's ELF header.
pub fn code_object_arch(bytes: &[u8]) -> Result<CodeObjectArch, ElfError> {
    if bytes.starts_with(b"__CLANG_OFFLOAD_BUNDLE__") {
        return Err(ElfError::OffloadBundle);
    }
    if bytes.len() < 64 {
        return Err(ElfError::TooShort { len: bytes.len() });
    }
    let magic = [bytes[0], bytes[1], bytes[2], bytes[3]];
    if magic != *b"\x7fELF" {
        return Err(ElfError::NotElf { found: magic });
    }
    let (class, data) = (bytes[4], bytes[5]);
    if class != 2 || data != 1 {
        return Err(ElfError::Not64BitLittleEndian { class, data });
    }
    let os_abi = bytes[7];
    let abi_version = bytes[8];
    let machine = u16::from_le_bytes([bytes[18], bytes[19]]);
    // e_flags follows e_entry, e_phoff and e_shoff (8 bytes each) in the 64-bit header.
    let flags = u32::from_le_bytes([bytes[48], bytes[49], bytes[50], bytes[51]]);
    match machine {
        EM_AMDGPU => {
            if os_abi != ELFOSABI_AMDGPU_HSA {
                return Err(ElfError::WrongOsAbi { os_abi });
            }
            let mach = flags & EF_AMDGPU_MACH;
            let name = AMDGPU_MACH
                .iter()
                .find(|(_, value)| *value == mach)
                .map(|(name, _)| name.to_string())
                .unwrap_or_else(|| format!("unknown EF_AMDGPU_MACH {mach:#04x}"));
            Ok(CodeObjectArch::Amdgpu(name))
        }
        EM_CUDA => {
            let sm = if abi_version == ELFABIVERSION_CUDA_V1 {
                flags & 0xff
            } else {
                (flags >> 8) & 0xff
            };
            Ok(CodeObjectArch::Cuda(format!("sm_{sm}")))
        }
        machine => Err(ElfError::UnknownMachine { machine }),
    }
}

/// Checks that `bytes` is a code object for `target` (a targets.toml name: `gfx1201`, `sm_90`).
pub fn verify_code_object(bytes: &[u8], target: &str) -> Result<CodeObjectArch, ElfError> {
    let arch = code_object_arch(bytes)?;
    let matches = match &arch {
        CodeObjectArch::Amdgpu(name) | CodeObjectArch::Cuda(name) => name == target,
    };
    if matches {
        Ok(arch)
    } else {
        Err(ElfError::WrongArch {
            expected: target.to_string(),
            found: arch,
        })
    }
}

/// The EF_AMDGPU_MACH value of a processor, for crafting headers in tests.
#[cfg(test)]
pub fn amdgpu_mach(target: &str) -> Option<u32> {
    AMDGPU_MACH
        .iter()
        .find(|(name, _)| *name == target)
        .map(|(_, value)| *value)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 64-byte ELF64 little-endian header with the given fields; the rest is zero.
    fn header(machine: u16, os_abi: u8, abi_version: u8, flags: u32) -> Vec<u8> {
        let mut bytes = vec![0u8; 64];
        bytes[..4].copy_from_slice(b"\x7fELF");
        bytes[4] = 2;
        bytes[5] = 1;
        bytes[6] = 1;
        bytes[7] = os_abi;
        bytes[8] = abi_version;
        bytes[16..18].copy_from_slice(&3u16.to_le_bytes());
        bytes[18..20].copy_from_slice(&machine.to_le_bytes());
        bytes[48..52].copy_from_slice(&flags.to_le_bytes());
        bytes
    }

    fn amdgpu(target: &str) -> Vec<u8> {
        // 0x300 sets the xnack/sramecc "any" bits above the mach byte, as clang does: they must
        // not disturb the architecture.
        header(
            EM_AMDGPU,
            ELFOSABI_AMDGPU_HSA,
            3,
            amdgpu_mach(target).unwrap() | 0x300,
        )
    }

    #[test]
    fn every_amdgpu_target_in_targets_toml_has_a_mach_value() {
        let targets = crate::targets::load().unwrap();
        for target in targets
            .targets
            .iter()
            .filter(|t| t.kind == crate::targets::Kind::Amdgpu)
        {
            assert!(
                amdgpu_mach(&target.name).is_some(),
                "no EF_AMDGPU_MACH for {}",
                target.name
            );
        }
    }

    #[test]
    fn amdgpu_headers_name_their_processor() {
        for target in [
            "gfx90a", "gfx942", "gfx1100", "gfx1151", "gfx1152", "gfx1200", "gfx1201",
        ] {
            assert_eq!(
                verify_code_object(&amdgpu(target), target),
                Ok(CodeObjectArch::Amdgpu(target.to_string()))
            );
        }
    }

    #[test]
    fn wrong_amdgpu_processor_is_rejected() {
        assert_eq!(
            verify_code_object(&amdgpu("gfx1200"), "gfx1201")
                .unwrap_err()
                .to_string(),
            "expected a code object for gfx1201, found one for gfx1200"
        );
        let unknown = header(EM_AMDGPU, ELFOSABI_AMDGPU_HSA, 3, 0x7e);
        assert_eq!(
            verify_code_object(&unknown, "gfx1201")
                .unwrap_err()
                .to_string(),
            "expected a code object for gfx1201, found one for unknown EF_AMDGPU_MACH 0x7e"
        );
    }

    #[test]
    fn cuda_headers_in_both_abi_layouts() {
        // ABI 7: SM in the low byte (sm_90 = 0x5a); ABI 8: SM in bits 8..16.
        let old = header(EM_CUDA, 0x33, 7, 0x0050_0000 | 0x5a);
        assert_eq!(
            verify_code_object(&old, "sm_90"),
            Ok(CodeObjectArch::Cuda("sm_90".into()))
        );
        let new = header(EM_CUDA, 0x41, 8, 0x0600_5a04);
        assert_eq!(
            verify_code_object(&new, "sm_90"),
            Ok(CodeObjectArch::Cuda("sm_90".into()))
        );
        assert_eq!(
            verify_code_object(&new, "sm_80").unwrap_err().to_string(),
            "expected a code object for sm_80, found one for sm_90"
        );
    }

    /// ELF headers of real code objects: nvcc 13.0 `-cubin -arch=sm_80` (ELF ABI 8) on the GPU
    /// machine, Debian clang 19 `--offload-arch=gfx1201` and `gfx90a` (xnack/sramecc "any") here.
    #[test]
    fn real_code_object_headers() {
        let check = |header: &str, target: &str| {
            let bytes = hex::decode(header).unwrap();
            assert_eq!(
                verify_code_object(&bytes, target).map(|arch| arch.to_string()),
                Ok(target.to_string())
            );
        };
        check("7f454c460201014108000000000000000200be00010000000000000000000000401700000000000080130000000000000450000640003800040040000f000100", "sm_80");
        check("7f454c460201014003000000000000000300e000010000000000000000000000400000000000000090130000000000004e00000040003800090040000f000d00", "gfx1201");
        check("7f454c460201014003000000000000000300e0000100000000000000000000004000000000000000d0150000000000003f05000040003800090040000f000d00", "gfx90a");
    }

    #[test]
    fn malformed_files_are_rejected_with_what_was_found() {
        let check = |bytes: &[u8], expected: &str| {
            assert_eq!(code_object_arch(bytes).unwrap_err().to_string(), expected);
        };
        check(
            b"\x7fELF",
            "expected an ELF header of 64 bytes, found a file of 4 bytes",
        );
        check(
            &[0u8; 64],
            "expected the ELF magic 7f 45 4c 46, found 00 00 00 00",
        );
        check(
            b"__CLANG_OFFLOAD_BUNDLE__\x02\0\0\0",
            "expected a bare ELF code object, found a clang offload bundle (compile with --no-gpu-bundle-output)",
        );
        let mut elf32 = amdgpu("gfx1201");
        elf32[4] = 1;
        check(
            &elf32,
            "expected a 64-bit little-endian ELF (class 2, data 1), found class 1, data 1",
        );
        check(
            &header(62, 0, 0, 0),
            "expected e_machine EM_AMDGPU (224) or EM_CUDA (190), found 62",
        );
        check(
            &header(EM_AMDGPU, 0, 0, 0x4e),
            "expected OS/ABI AMDGPU_HSA (64) in an AMDGPU code object, found 0",
        );
    }
}
