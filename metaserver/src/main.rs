//! `pegaflow-metaserver`: see the library documentation (`pegaflow_metaserver`).

fn main() -> std::process::ExitCode {
    pegaflow_metaserver::main()
}
