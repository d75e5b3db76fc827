// Builds MiB mebibytes: half in Buffers, half as a V8 object graph; churns a quarter of the
// objects; checks every Buffer and object; prints `ok MiB MiB peak-rss-anon-mib N`.
// Usage: node --max-old-space-size=2048 heap_churn.js MiB
const fs = require('fs');
let peak = 0;
function sample() {
  const m = /RssAnon:\s+(\d+)/.exec(fs.readFileSync('/proc/self/status', 'utf8'));
  peak = Math.max(peak, Number(m[1]) >> 10);
}
function fillBuf(b, seed) { for (let i = 0; i < b.length; i += 4) b.writeUInt32LE((seed * 2654435761 + i) >>> 0, i); }
function leaf(c, i, gen) { const s = []; for (let k = 0; k < 16; k++) s.push((c * 131 + i * 7 + k + gen) | 0); return { c, i, gen, s }; }
const mib = Number(process.argv[2]);
const bufs = [], objs = [], gen = [];
for (let c = 0; c < mib / 2; c++) { const b = Buffer.allocUnsafe(1 << 20); fillBuf(b, c); bufs.push(b); if (c % 16 == 0) sample(); }
const chunks = mib * 2; // ~256 KiB of objects each (about 1,000 leaves)
for (let c = 0; c < chunks; c++) { const a = []; for (let i = 0; i < 1000; i++) a.push(leaf(c, i, 0)); objs.push(a); gen.push(0); if (c % 64 == 0) sample(); }
for (let n = 0; n < chunks / 4; n++) { const c = (n * 7919) % chunks; gen[c]++; for (let i = 0; i < 1000; i++) objs[c][i] = leaf(c, i, gen[c]); }
sample();
for (let c = 0; c < bufs.length; c++) { const b = Buffer.allocUnsafe(1 << 20); fillBuf(b, c); if (!b.equals(bufs[c])) { console.log('mismatch buffer ' + c); process.exit(1); } }
for (let c = 0; c < chunks; c++) for (let i = 0; i < 1000; i++) { const o = objs[c][i], w = leaf(c, i, gen[c]); if (o.gen !== w.gen || o.s.join() !== w.s.join()) { console.log('mismatch object ' + c + '/' + i); process.exit(1); } }
sample();
console.log('ok ' + mib + ' MiB peak-rss-anon-mib ' + peak);
