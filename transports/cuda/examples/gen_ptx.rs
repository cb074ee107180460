//! Regenerates `src/kernels.ptx` from `src/kernels.cu` with NVRTC (loaded at run time; no GPU
//! needed). Run: `cargo run -p pegaflow-transport-cuda --features nvrtc-gen --example gen_ptx`
//! with a libnvrtc on the library path. It targets `compute_70`, so the committed PTX loads on
//! every GPU from Volta on, and the driver compiles it for the GPU at hand.

use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};

fn main() -> anyhow::Result<()> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src");
    let src = std::fs::read_to_string(format!("{dir}/kernels.cu"))?;
    let opts = CompileOptions {
        arch: Some("compute_70"),
        name: Some("kernels.cu".into()),
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(&src, opts).map_err(|e| anyhow::anyhow!("NVRTC: {e:?}"))?;
    std::fs::write(format!("{dir}/kernels.ptx"), ptx.to_src())?;
    println!("wrote {dir}/kernels.ptx");
    Ok(())
}
