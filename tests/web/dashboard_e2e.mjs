// End-to-end tests of the dashboard in a real headless Chromium (Debian's
// /usr/bin/chromium driven by playwright-core from web/node_modules), against a
// real `dvr serve` on a loopback port with a scratch store:
//   1. the overview loads (hosts, memory chart, the store);
//   2. a snapshot taken from Python (import memdvr) appears in the timeline
//      while the page is open (auto-refresh), and its details and diff show;
//   3. a job started with `dvr run` and dumped with `dvr proc dump
//      --leave-running` is cloned from the jobs view: the operation finishes,
//      the clone's pid is alive (then it is killed);
//   4. a byte flipped in a pack file: Verify from the overview, and the alerts
//      view shows a damaged_snapshot alert naming the snapshot; an ended
//      program whose autosave failed shows in the jobs view and the alerts,
//      and its Dismiss button removes both;
//   5. against a server with --token-file, the page asks for the token (again
//      after a wrong one) and then reads and changes things with it.
// A screenshot of each step goes to DVR_E2E_SCREENSHOTS (CTest: build/e2e-screenshots).
// Run by tests/web/run_e2e.sh (CTest test "dashboard_e2e"), which finds what it needs.
// Environment: DVR_BIN, DVR_TEST_JOB, DVR_WEB_ROOT, DVR_PYTHONPATH, DVR_WEB_DIR, DVR_E2E_SCREENSHOTS, CHROMIUM.

import assert from 'node:assert/strict';
import { spawn, spawnSync } from 'node:child_process';
import fs from 'node:fs';
import { createRequire } from 'node:module';
import os from 'node:os';
import path from 'node:path';

const env = (k) => {
  const v = process.env[k];
  if (!v) throw new Error(`dashboard_e2e: set ${k} (tests/web/run_e2e.sh does)`);
  return v;
};
const DVR = env('DVR_BIN');
const JOB = env('DVR_TEST_JOB');
const WEB_ROOT = env('DVR_WEB_ROOT');
const PYTHONPATH = env('DVR_PYTHONPATH');
const SHOTS = env('DVR_E2E_SCREENSHOTS');
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';
const { chromium } = createRequire(path.join(env('DVR_WEB_DIR'), 'package.json'))('playwright-core');

const WAIT = 60_000; // generous: the machine may be loaded; nothing here measures time
const work = fs.mkdtempSync(path.join(fs.existsSync('/dev/shm') ? '/dev/shm' : os.tmpdir(), 'dvr-web-e2e-'));
const store = path.join(work, 'store');
const MARK = 'DVR-E2E-MARKER!!'; // at the start of the Python array: where to damage the pack
const pids = new Set(); // processes to kill at the end
const children = [];
let step = 0;

function log(msg) {
  process.stdout.write(`dashboard_e2e: ${msg}\n`);
}

async function shot(page, name) {
  step++;
  const file = path.join(SHOTS, `${String(step).padStart(2, '0')}-${name}.png`);
  await page.screenshot({ path: file, fullPage: true });
  log(`screenshot ${file}`);
}

function dvr(...args) {
  const r = spawnSync(DVR, ['--store', store, ...args], { encoding: 'utf8', timeout: 120_000 });
  assert.equal(r.status, 0, `dvr ${args.join(' ')} exited ${r.status}:\n${r.stdout}\n${r.stderr}`);
  return r.stdout;
}

function alive(pid) {
  try {
    process.kill(pid, 0);
    const stat = fs.readFileSync(`/proc/${pid}/stat`, 'utf8');
    return !/\) Z /.test(stat); // a zombie is not alive
  } catch {
    return false;
  }
}

/** An error that ends a wait at once (a process it waits on has exited). */
class Fatal extends Error {}

async function until(what, f, timeout = WAIT) {
  const end = Date.now() + timeout;
  let last;
  for (;;) {
    try {
      const v = await f();
      if (v) return v;
    } catch (e) {
      if (e instanceof Fatal) throw e;
      last = e;
    }
    if (Date.now() > end) throw new Error(`dashboard_e2e: timed out waiting for ${what}${last ? ` (${last.message})` : ''}`);
    await new Promise((r) => setTimeout(r, 250));
  }
}

/** A Python process that holds a memdvr session and takes a snapshot per line on stdin. */
function startPython() {
  const code = `
import os, sys, numpy as np, memdvr
store = memdvr.Store(sys.argv[1])
s = memdvr.Session(store, "e2e")
a = s.array("data", (64, 4096), np.uint8)
a[:] = np.frombuffer(os.urandom(a.size), np.uint8).reshape(a.shape)
a[0, :16] = np.frombuffer(b"${MARK}", np.uint8)
for line in sys.stdin:
    name, label = line.rstrip("\\n").split(" ", 1)
    a[1:9, :] = np.frombuffer(os.urandom(8 * 4096), np.uint8).reshape(8, 4096)  # changes 8 pages
    s.snapshot(name, label=label)
    print("took", name, flush=True)
`;
  const p = spawn('/usr/bin/python3', ['-c', code, store], {
    env: { ...process.env, PYTHONPATH }, stdio: ['pipe', 'pipe', 'inherit'],
  });
  children.push(p);
  let out = '';
  p.stdout.on('data', (d) => { out += d; });
  return {
    async snapshot(name, label) {
      p.stdin.write(`${name} ${label}\n`);
      await until(`Python's snapshot ${name}`, () => out.includes(`took ${name}\n`) || (p.exitCode !== null && Promise.reject(new Fatal(`the Python process exited ${p.exitCode}`))));
    },
    close() { p.stdin.end(); },
  };
}

/** Starts `dvr serve` on a free loopback port (port 0: it says which on stdout); its base URL and health. */
async function startServe(name, ...extra) {
  const serveLog = path.join(work, `${name}.log`);
  const logFd = fs.openSync(serveLog, 'a');
  const serve = spawn(DVR, ['serve', '--listen', '127.0.0.1:0', '--store', store, '--web-root', WEB_ROOT, ...extra],
    { stdio: ['ignore', 'pipe', logFd] });
  children.push(serve);
  let serveOut = '';
  serve.stdout.on('data', (d) => { serveOut += d; });
  const port = await until(`${name} to say where it listens`, () => {
    if (serve.exitCode !== null) throw new Fatal(`${name} exited ${serve.exitCode} before it listened: ${fs.readFileSync(serveLog, 'utf8')}`);
    for (const line of serveOut.split('\n')) {
      if (!line.startsWith('{')) continue;
      const ev = JSON.parse(line);
      if (ev.event === 'listening') return ev.port;
    }
    return null;
  });
  const base = `http://127.0.0.1:${port}`;
  const health = await until(`${name} to answer /api/v1/health`, async () => {
    if (serve.exitCode !== null) throw new Fatal(`${name} exited ${serve.exitCode} before it answered`);
    const r = await fetch(`${base}/api/v1/health`);
    return r.ok ? r.json() : null;
  });
  return { base, health };
}

async function main() {
  fs.mkdirSync(SHOTS, { recursive: true });
  for (const f of fs.readdirSync(SHOTS)) if (f.endsWith('.png')) fs.rmSync(path.join(SHOTS, f));

  const py = startPython();
  await py.snapshot('base', 'the first snapshot');

  const { base, health } = await startServe('serve');
  log(`dvr serve ${health.version} on ${base}`);

  const browser = await chromium.launch({ executablePath: CHROMIUM, args: ['--no-sandbox'] });
  try {
    const page = await browser.newPage({ viewport: { width: 1280, height: 860 } });
    const errors = [];
    page.on('pageerror', (e) => errors.push(String(e)));
    page.on('console', (m) => { if (m.type() === 'error') errors.push(m.text()); });
    page.on('requestfailed', (r) => { if (!r.url().startsWith(base)) errors.push(`a request left the server: ${r.url()}`); });
    page.on('request', (r) => { if (!r.url().startsWith(base) && !r.url().startsWith('data:')) errors.push(`a request left the server: ${r.url()}`); });

    // 1. the overview
    await page.goto(`${base}/`);
    const storeId = path.basename(store);
    await page.locator(`.stores tr[data-store="${storeId}"]`).waitFor({ timeout: WAIT });
    await page.locator('.host-card').first().waitFor();
    await page.locator('svg.chart').waitFor();
    assert.equal(await page.locator('.host-card h3').first().innerText().then((t) => t.includes(health.host)), true, 'the host card names the host');
    // the alert count shows only when there are alerts (there may be some: a low /dev/shm, say)
    await until('the alert badge to match /api/v1/alerts', async () => {
      const n = (await (await fetch(`${base}/api/v1/alerts`)).json()).alerts.length;
      const badge = page.locator('#alert-badge');
      return n === 0 ? !(await badge.isVisible()) : (await badge.isVisible()) && (await badge.innerText()) === String(n);
    });
    await shot(page, 'overview');

    // 2. the timeline, and a snapshot from Python appearing in it
    await page.goto(`${base}/#/timeline/${encodeURIComponent(storeId)}/e2e`);
    await page.locator('g.node[data-snapshot="base"]').waitFor({ timeout: WAIT });
    await shot(page, 'timeline-base');
    await py.snapshot('from-python', 'taken from <Python> while the page was open');
    await page.locator('g.node[data-snapshot="from-python"]').waitFor({ timeout: WAIT }); // the auto-refresh brings it
    await page.locator('g.node[data-snapshot="from-python"]').click();
    const details = page.locator('.details[data-snapshot="from-python"]');
    await details.waitFor({ timeout: WAIT });
    const text = await details.innerText();
    assert.match(text, /taken from <Python> while the page was open/, 'the label shows as text');
    assert.match(text, /Diff against its parent base/, 'the diff against the parent shows');
    assert.match(await details.locator('.diff td').nth(4).innerText(), /^8$/, 'the diff counts the 8 pages Python changed');
    await shot(page, 'timeline-from-python');

    // 3. clone a dumped job from the jobs view
    const statusFile = path.join(work, 'job.status');
    const pid = Number(dvr('run', '--output', path.join(work, 'job.out'), '--', JOB, 'counter', '--mib', '4', '--status', statusFile).trim());
    assert.ok(pid > 0 && alive(pid), `dvr run printed the pid ${pid} of a running job`);
    pids.add(pid);
    await until('the job to report', () => fs.existsSync(statusFile) && fs.readFileSync(statusFile, 'utf8').length > 0);
    const dump = JSON.parse(dvr('proc', 'dump', String(pid), '--name', 'e2e-job', '--leave-running', '--json'));
    assert.equal(dump.name, 'e2e-job');
    await page.goto(`${base}/#/jobs`);
    await page.locator(`.jobs tr[data-pid="${pid}"]`).waitFor({ timeout: WAIT }); // the running dvr run job
    const row = page.locator(`.processes tr[data-process="e2e-job"]`);
    await row.waitFor({ timeout: WAIT });
    await row.locator('button[data-action="proc-clone"]').click();
    const op = page.locator('.op[data-action="proc-clone"]').first();
    await until('the clone operation to finish', async () => ['done', 'failed'].includes(await op.getAttribute('data-state')));
    assert.equal(await op.getAttribute('data-state'), 'done', `the clone failed: ${await op.innerText()}`);
    const clone = Number(await op.getAttribute('data-pid'));
    assert.ok(clone > 0 && clone !== pid, `the clone has a pid of its own (${clone})`);
    pids.add(clone);
    assert.ok(alive(clone), `the clone's pid ${clone} runs`);
    assert.ok(alive(pid), 'the original runs beside the clone');
    await shot(page, 'jobs-clone');
    process.kill(clone, 'SIGKILL');
    await until('the clone to end', () => !alive(clone));
    log(`cloned e2e-job as pid ${clone}, alive, killed`);

    // 4. a damaged snapshot raises an alert
    const packs = path.join(store, 'packs');
    let damaged = false;
    for (const f of fs.readdirSync(packs).filter((x) => x.endsWith('.pack'))) {
      const file = path.join(packs, f);
      const fd = fs.openSync(file, 'r+');
      const size = fs.fstatSync(fd).size;
      const buf = Buffer.alloc(Math.min(size, 64 << 20));
      fs.readSync(fd, buf, 0, buf.length, 0);
      const at = buf.indexOf(MARK);
      if (at >= 0) {
        const b = Buffer.from([buf[at + 100] ^ 0xff]);
        fs.writeSync(fd, b, 0, 1, at + 100);
        damaged = true;
        log(`flipped the byte at ${at + 100} of ${file}`);
      }
      fs.closeSync(fd);
      if (damaged) break;
    }
    assert.ok(damaged, 'found the Python array in a pack file');
    await page.goto(`${base}/#/overview`);
    await page.locator(`.stores tr[data-store="${storeId}"] button[data-action="verify"]`).click();
    const vop = page.locator('.op[data-action="verify"]').first();
    await until('verify to finish', async () => ['done', 'failed'].includes(await vop.getAttribute('data-state')));
    await page.goto(`${base}/#/alerts`);
    const alert = page.locator('tr.alert[data-kind="damaged_snapshot"]').first();
    await alert.waitFor({ timeout: WAIT });
    assert.match(await alert.innerText(), /base|from-python/, 'the alert names the damaged snapshot');
    const alertCount = await page.locator('tr.alert').count();
    await until('the navigation bar to count the alerts', async () =>
      (await page.locator('#alert-badge').isVisible()) && (await page.locator('#alert-badge').innerText()) === String(alertCount));
    await shot(page, 'alerts');

    // 4b. an ended program whose last autosave failed: a job kept for its
    // error and an autosave_failed alert, both gone after Dismiss
    const ended = spawnSync('true').pid;
    const runDir = path.join(store, 'run');
    fs.mkdirSync(runDir, { recursive: true, mode: 0o700 });
    fs.writeFileSync(path.join(runDir, `${ended}.autosave.e2e.json`), JSON.stringify({
      schema_version: 1, pid: ended, start_ticks: 1, started_ns: (Date.now() - 3_600_000) * 1e6, kind: 'autosave', session: 'e2e', command: 'python3 sweep.py',
      heap: '', interval_s: 60, last_dump: '', last_dump_ns: 0, last_error: 'snapshot e2e/autosave-7: no space left <b>', updated_ns: 1,
    }), { mode: 0o600 });
    await page.goto(`${base}/#/alerts`);
    await page.locator('tr.alert[data-kind="autosave_failed"]').waitFor({ timeout: WAIT });
    await page.goto(`${base}/#/jobs`);
    const endedRow = page.locator(`.jobs tr[data-pid="${ended}"]`);
    await endedRow.waitFor({ timeout: WAIT });
    assert.match(await endedRow.innerText(), /autosave of e2e[\s\S]*no space left <b>/, 'the ended autosave shows with its error, as text');
    await shot(page, 'jobs-autosave-failed');
    await endedRow.locator('button[data-action="dismiss"]').click();
    await endedRow.waitFor({ state: 'detached', timeout: WAIT });
    assert.equal(fs.existsSync(path.join(runDir, `${ended}.autosave.e2e.json`)), false, 'Dismiss removed the record');
    await page.goto(`${base}/#/alerts`);
    await until('the autosave_failed alert to go', async () => (await page.locator('tr.alert[data-kind="autosave_failed"]').count()) === 0);

    assert.deepEqual(errors, [], 'no errors in the page and no request left the server');

    // 5. a server with --token-file: the dashboard asks for the token, refuses a wrong one, then works
    const tokenFile = path.join(work, 'token');
    fs.writeFileSync(tokenFile, 'e2e-secret-token\n', { mode: 0o600 });
    const t = await startServe('serve-token', '--token-file', tokenFile);
    assert.equal(t.health.auth, 'token');
    const tpage = await browser.newPage({ viewport: { width: 1280, height: 860 } });
    tpage.on('pageerror', (e) => errors.push(String(e)));
    await tpage.goto(`${t.base}/`);
    await tpage.locator('#token-form').waitFor({ timeout: WAIT });
    await shot(tpage, 'token-prompt');
    await tpage.fill('#token-input', 'wrong');
    await tpage.click('#token-form button[type="submit"]');
    await until('the prompt to say the token was refused', async () =>
      (await tpage.locator('#token-form').count()) > 0 && /refused/.test(await tpage.locator('#token-form').innerText()));
    await tpage.fill('#token-input', 'e2e-secret-token');
    await tpage.click('#token-form button[type="submit"]');
    await tpage.locator(`.stores tr[data-store="${storeId}"]`).waitFor({ timeout: WAIT });
    assert.equal(await tpage.evaluate(() => sessionStorage.getItem('dvr-token')), 'e2e-secret-token', 'the token is kept for this tab');
    await tpage.locator(`.stores tr[data-store="${storeId}"] button[data-action="gc"]`).click(); // a POST with the bearer token
    const gop = tpage.locator('.op[data-action="gc"]').first();
    await until('gc to finish', async () => ['done', 'failed'].includes(await gop.getAttribute('data-state')));
    assert.equal(await gop.getAttribute('data-state'), 'done', `gc with the token failed: ${await gop.innerText()}`);
    await shot(tpage, 'token-overview');
    assert.deepEqual(errors.filter((e) => !/401/.test(e)), [], 'no errors in the page (the refused requests aside)');
    log('all steps passed');
  } finally {
    await browser.close();
    py.close();
  }
}

let failed = false;
try {
  await main();
} catch (e) {
  failed = true;
  console.error(e && e.stack ? e.stack : e);
  const serveLog = path.join(work, 'serve.log');
  if (fs.existsSync(serveLog)) console.error(`dvr serve's log:\n${fs.readFileSync(serveLog, 'utf8').slice(-4000)}`);
} finally {
  for (const pid of pids) if (alive(pid)) { try { process.kill(pid, 'SIGKILL'); } catch { /* gone */ } }
  for (const c of children) if (c.exitCode === null) c.kill('SIGTERM');
  await new Promise((r) => setTimeout(r, 300));
  for (const c of children) if (c.exitCode === null) c.kill('SIGKILL');
  fs.rmSync(work, { recursive: true, force: true });
}
process.exit(failed ? 1 : 0);
