//! Goal: a pool created with `--error-if-no-space` answers a write that needs a data block it
//! does not have with NBD's ENOSPC, `status` shows the mode, and growing the data device
//! through the control socket while serving lets writes proceed.
//!
//! Method: a pool of 16 data blocks, a larger volume, our raw client filling it block by block;
//! then `thinpool create --grow --data-size` against the served pool.

mod e2e_support;

use e2e_support::*;

const BLOCK: u64 = 64 * 1024;

#[test]
fn out_of_space_is_enospc_until_the_data_grows() {
    let temp = ScratchDir::new("serve-nospace");
    let pool = temp.join("pool");
    let p = pool.to_str().unwrap();
    create_pool(&pool, &["--data-size", "1M", "--error-if-no-space"]);
    create_volume(&pool, "big", "8M");
    let served = serve(&pool, &["--quiet"]);
    let mut client = Client::open(&served.socket, "big");
    for block in 0..16 {
        assert_eq!(
            client.write_errno(block * BLOCK, &pattern(block, BLOCK as usize)),
            0
        );
    }
    assert_eq!(
        client.write_errno(16 * BLOCK, &pattern(16, BLOCK as usize)),
        ENOSPC
    );
    // Overwriting a provisioned block needs no space.
    client.write(0, &pattern(100, BLOCK as usize));
    let status: serde_json::Value =
        serde_json::from_str(&thinpool_ok(&["status", "--json", "--pool", p])).unwrap();
    assert_eq!(status["data_used_blocks"], 16);
    assert_eq!(status["mode"], "out_of_data_space");

    let grown: serde_json::Value = serde_json::from_str(&thinpool_ok(&[
        "create",
        "--grow",
        "--data-size",
        "2M",
        "--json",
        "--pool",
        p,
    ]))
    .unwrap();
    assert_eq!(grown["data_total_blocks"], 32);
    assert_eq!(grown["mode"], "rw");
    client.write(16 * BLOCK, &pattern(16, BLOCK as usize));
    client.flush();
    assert_eq!(client.read(0, BLOCK), pattern(100, BLOCK as usize));
    assert_eq!(client.read(16 * BLOCK, BLOCK), pattern(16, BLOCK as usize));
    client.disconnect();
    assert!(served.stop().success());
}
