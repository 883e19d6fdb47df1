//! Compile a kernel with NVRTC and launch it on gpumem buffers:
//! `cargo run --release -p gpumem --example nvrtc_kernel`.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use gpumem::Device;
use gpumem::{Config, DeviceBuffer, Stream};

const SRC: &str = r#"
extern "C" __global__ void saxpy(float* y, const float* x, float a, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}"#;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if !gpumem::device::cuda_available() {
        println!(
            "no CUDA GPU here: this example needs one (gpumem's host backend cannot run kernels)"
        );
        return Ok(());
    }
    let ctx = gpumem::resource::cuda::primary_context(0)?;
    let stream = ctx.new_stream()?;
    let alloc = Device::cuda(0, Config::from_env()?)?;
    let s = Stream::from(&*stream);

    let n = 1 << 20;
    let x: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let xb = DeviceBuffer::from_slice(&alloc, s, &x)?;
    let mut yb = DeviceBuffer::<f32>::zeroed(&alloc, s, n)?;

    let module = ctx.load_module(cudarc::nvrtc::compile_ptx(SRC)?)?;
    let saxpy = module.load_function("saxpy")?;
    let (a, nn) = (2.0f32, n as u64);
    let mut launch = stream.launch_builder(&saxpy);
    launch.arg(&mut yb).arg(&xb).arg(&a).arg(&nn);
    // SAFETY: `yb` and `xb` hold n floats each; the kernel touches indices below n.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }?;

    let y = yb.to_vec()?;
    assert!(y.iter().zip(&x).all(|(y, x)| *y == 2.0 * x));
    println!("saxpy on {} gpumem floats: ok (y[12345] = {})", n, y[12345]);
    print!("{}", alloc.memory_summary());
    Ok(())
}
