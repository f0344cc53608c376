//! The signer on its own: one and two secrets (a rotation window) over
//! bodies of 1 KiB and 64 KiB. `cargo bench -p relay-signing`.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use relay_signing::{SigningSecret, signature_header};

fn signer(c: &mut Criterion) {
    let secrets =
        [SigningSecret::new("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"), SigningSecret::new("whsec_previousSecretStillSigningFor24h")];
    let mut group = c.benchmark_group("signature_header");
    for size in [1024usize, 64 * 1024] {
        let body = vec![b'x'; size];
        group.throughput(Throughput::Bytes(size as u64));
        for n in [1usize, 2] {
            group.bench_with_input(BenchmarkId::new(format!("{n} secret(s)"), size), &body, |b, body| {
                b.iter(|| signature_header(black_box(&secrets[..n]), black_box("1764547200"), black_box(body)))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, signer);
criterion_main!(benches);
