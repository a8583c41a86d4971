//! The embedded PTX targets old drivers and GPUs: PTX ISA 8.0 (CUDA 12.0 drivers) and sm_52, and
//! uses only instructions that exist there. On a GPU, the lowered PTX loads and computes.

mod common;

use cuda_stream_pool::kernels::{Kernels, PTX};
use cuda_stream_pool::DeviceBuffer;

fn directive<'a>(name: &str) -> &'a str {
    PTX.lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix(name))
        .map(str::trim)
        .unwrap_or_else(|| panic!("no {name} directive in the PTX"))
}

#[test]
fn ptx_isa_and_target_are_the_oldest_supported() {
    let version: Vec<u32> = directive(".version")
        .split('.')
        .map(|x| x.parse().unwrap())
        .collect();
    assert!(
        version <= vec![8, 0],
        "PTX ISA {version:?} needs a driver newer than CUDA 12.0"
    );
    let target = directive(".target");
    let sm: u32 = target.trim_start_matches("sm_").parse().unwrap();
    assert!(sm <= 52, "target {target} excludes GPUs the crate supports");
}

#[test]
fn ptx_uses_only_instructions_of_old_isas() {
    // Every instruction the kernels use, all available since PTX ISA 2.x / sm_20.
    const ALLOWED: &[&str] = &[
        "ld.param.u64",
        "ld.param.u32",
        "cvta.to.global.u64",
        "mov.u32",
        "mad.lo.s32",
        "setp.ge.u32",
        "mul.wide.u32",
        "add.s64",
        "ld.global.f32",
        "st.global.f32",
        "ld.global.u32",
        "st.global.u32",
        "add.f32",
        "add.s32",
        "atom.global.add.f32",
        "ret",
        "bra.uni",
        "bra",
    ];
    let mut seen = 0;
    for line in PTX.lines().map(str::trim) {
        if line.is_empty()
            || line.starts_with("//")
            || line.starts_with('.')
            || line.starts_with('{')
            || line.starts_with('}')
            || line.starts_with(')')
            || line.starts_with('$')
            || line == "\0"
        {
            continue;
        }
        let line = line.strip_prefix("@%p1").unwrap_or(line).trim();
        let op = line
            .split_whitespace()
            .next()
            .unwrap()
            .trim_end_matches(';');
        assert!(
            ALLOWED.contains(&op),
            "instruction {op:?} is not in the allow list"
        );
        seen += 1;
    }
    assert!(
        seen > 20,
        "only {seen} instructions found: the parser is broken"
    );
}

fn sums(d: &std::sync::Arc<dyn cuda_stream_pool::driver::Driver>) {
    let ctx = common::ctx(d);
    let k = Kernels::load(&ctx).unwrap();
    let owner = ctx.owner();
    let s = owner.stream().unwrap();
    let x = DeviceBuffer::<f32>::zeroed(&s, 4096).unwrap();
    let out = DeviceBuffer::<f32>::zeroed(&s, 1).unwrap();
    k.add_one(&s, &x).unwrap();
    k.add_one(&s, &x).unwrap();
    k.sum(&s, &x, &out).unwrap();
    let u = DeviceBuffer::<u32>::zeroed(&s, 1000).unwrap();
    k.add_u32(&s, &u, 7).unwrap();
    assert_eq!(out.to_vec(&s).unwrap(), vec![8192.0]);
    assert!(u.to_vec(&s).unwrap().iter().all(|&v| v == 7));
}

#[test]
fn lowered_ptx_computes_on_the_simulation() {
    sums(&common::sim());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn lowered_ptx_loads_and_computes_on_the_gpu() {
    let _g = common::gpu_lock();
    sums(&common::cuda());
}
