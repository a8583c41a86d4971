//! Pools are per context: owners on two devices at once, each device's pool and memory
//! independent. Runs on a simulation with two devices, and as a GPU test on a machine with two
//! GPUs (it passes with a message where there is only one).

mod common;

use cuda_stream_pool::driver::{Driver, SimConfig, SimDriver};
use cuda_stream_pool::kernels::Kernels;
use cuda_stream_pool::{Context, DeviceBuffer, Error};
use std::sync::Arc;

fn two_devices(d: &Arc<dyn Driver>) {
    d.init().unwrap();
    let n = d.device_count().unwrap();
    if n < 2 {
        eprintln!("multi_gpu: skipped, only {n} device(s)");
        return;
    }
    let ctxs: Vec<Context> = (0..2)
        .map(|i| Context::primary(d.clone(), i).unwrap())
        .collect();
    let kernels: Vec<Arc<Kernels>> = ctxs
        .iter()
        .map(|c| Arc::new(Kernels::load(c).unwrap()))
        .collect();
    // Threads that alternate between the devices, with owners alive on both at once.
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let (ctxs, kernels) = (ctxs.clone(), kernels.clone());
            std::thread::spawn(move || {
                let d = ctxs[0].driver().clone();
                // The thread's current context as found (none on a fresh thread): every call
                // below leaves it so, whichever device it used.
                let found = d.ctx_get_current().unwrap();
                for i in 0..200usize {
                    let a = ctxs[(t + i) % 2].owner();
                    let b = ctxs[(t + i + 1) % 2].owner();
                    let (ka, kb) = (&kernels[(t + i) % 2], &kernels[(t + i + 1) % 2]);
                    let (sa, sb) = (a.stream().unwrap(), b.stream().unwrap());
                    let xa = DeviceBuffer::<f32>::zeroed(&sa, 1024).unwrap();
                    let xb = DeviceBuffer::<f32>::zeroed(&sb, 512).unwrap();
                    ka.add_one(&sa, &xa).unwrap();
                    kb.add_one(&sb, &xb).unwrap();
                    kb.add_one(&sb, &xb).unwrap();
                    let (sum_a, sum_b) = (
                        DeviceBuffer::<f32>::zeroed(&sa, 1).unwrap(),
                        DeviceBuffer::<f32>::zeroed(&sb, 1).unwrap(),
                    );
                    ka.sum(&sa, &xa, &sum_a).unwrap();
                    kb.sum(&sb, &xb, &sum_b).unwrap();
                    assert_eq!(sum_a.to_vec(&sa).unwrap()[0], 1024.0);
                    assert_eq!(sum_b.to_vec(&sb).unwrap()[0], 1024.0);
                    // A buffer of one device cannot be used on the other's stream.
                    assert!(matches!(xa.use_on(&sb), Err(Error::InvalidArgument(_))));
                    assert_eq!(
                        d.ctx_get_current().unwrap(),
                        found,
                        "the current context changed"
                    );
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let (s0, s1) = (ctxs[0].stats(), ctxs[1].stats());
    eprintln!("multi_gpu: device 0 {s0:?}\nmulti_gpu: device 1 {s1:?}");
    for st in [s0, s1] {
        assert_eq!(st.in_use, 0);
        assert!(st.created <= 16, "{st:?}");
        assert_eq!(st.hits + st.misses, 1600, "{st:?}");
    }
}

#[test]
fn sim_two_devices() {
    let d: Arc<dyn Driver> = Arc::new(SimDriver::with_config(SimConfig {
        devices: 2,
        ..SimConfig::default()
    }));
    two_devices(&d);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_two_devices() {
    let _serial = common::gpu_lock();
    two_devices(&common::cuda());
}
