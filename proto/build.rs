//! Compiles `proto/engine.proto` with the vendored `protoc`, so no system protobuf compiler is needed.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; nothing else reads the environment concurrently.
    unsafe { std::env::set_var("PROTOC", protoc) };
    println!("cargo:rerun-if-changed=proto/engine.proto");
    // Both sides are generated; each is compiled only with its cargo feature (`client`,
    // `server`), so the generated file does not depend on which features are on.
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .client_mod_attribute(".", r#"#[cfg(feature = "client")]"#)
        .server_mod_attribute(".", r#"#[cfg(feature = "server")]"#)
        // Hand-written, so that a Save's hashes decode into one buffer per layer, each layer
        // from one contiguous slice (src/save.rs); the wire format is the .proto's.
        .extern_path(".pegaflow.SaveRequest", "crate::save::SaveRequest")
        .extern_path(".pegaflow.SaveLayer", "crate::save::SaveLayer")
        .compile_protos(&["proto/engine.proto"], &["proto"])?;
    Ok(())
}
