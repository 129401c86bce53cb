//! Serves a sparse in-memory export over NBD until stdin reaches end of file.
//!
//! ```text
//! cargo run -p nbd --example memory_server -- /tmp/nbd.sock disk 1073741824
//! nbdinfo 'nbd+unix:///disk?socket=/tmp/nbd.sock'
//! ```

use std::io::Read;
use std::sync::Arc;

fn main() {
    let mut args = std::env::args().skip(1);
    let socket = args.next().unwrap_or_else(|| "/tmp/nbd.sock".into());
    let name = args.next().unwrap_or_else(|| "disk".into());
    let size_bytes: u64 = args
        .next()
        .map(|text| text.parse().expect("size in bytes"))
        .unwrap_or(1 << 30);
    let exports = Arc::new(nbd::ExportMap::new());
    exports.insert(Arc::new(nbd::MemoryExport::new(name.clone(), size_bytes)));
    exports.set_default(Some(name));
    let config = nbd::Config {
        on_event: Some(Arc::new(|event| eprintln!("{event:?}"))),
        ..Default::default()
    };
    let mut server = nbd::Server::new(exports, config);
    server.listen_unix(&socket).expect("listen");
    eprintln!("serving on {socket}; close stdin to stop");
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    server.shutdown();
}
