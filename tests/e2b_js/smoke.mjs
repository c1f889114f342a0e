// The E2B JS SDK against dsec: E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY come from the test.
import { Sandbox } from 'e2b'

const sbx = await Sandbox.create('base/debian:12', { timeoutMs: 120_000 })
const out = {}
out.stdout = (await sbx.commands.run('echo hello from js')).stdout
await sbx.files.write('/root/x.txt', 'hi')
out.read = await sbx.files.read('/root/x.txt')
out.list = (await sbx.files.list('/root')).map((e) => e.name).sort()
try {
  await sbx.commands.run('exit 3')
} catch (e) {
  out.exitCode = e.exitCode
}
// E2B's default template: its user, a background process, stdin, a PTY, a watch, metadata
const base = await Sandbox.create({ timeoutMs: 120_000, metadata: { suite: 'js' } })
out.whoami = (await base.commands.run('id -un; pwd')).stdout
const bg = await base.commands.run('cat', { background: true, stdin: true })
await base.commands.sendStdin(bg.pid, 'echo through stdin\n')
await base.commands.closeStdin(bg.pid)
out.stdin = (await bg.wait()).stdout
let ptyOut = ''
const term = await base.pty.create({ cols: 80, rows: 24, onData: (d) => { ptyOut += new TextDecoder().decode(d) } })
await base.pty.resize(term.pid, { cols: 100, rows: 30 })
await base.pty.sendInput(term.pid, new TextEncoder().encode('stty size; exit\n'))
await term.wait()
out.pty = ptyOut.includes('30 100')
const events = []
await base.files.makeDir('w')
const watch = await base.files.watchDir('w', (e) => events.push(`${e.type}:${e.name}`), { recursive: true })
await base.files.write('w/f.txt', 'x', { metadata: { tag: 'js' } })
await new Promise((r) => setTimeout(r, 300))
await watch.stop()
out.watched = events.includes('create:f.txt')
out.metadata = (await base.files.getInfo('w/f.txt')).metadata
out.listed = (await Sandbox.list({ query: { metadata: { suite: 'js' } } }).nextItems()).map((s) => s.sandboxId)
  .includes(base.sandboxId)
await base.kill()
await sbx.pause()
const again = await Sandbox.connect(sbx.sandboxId)
out.afterConnect = (await again.commands.run('cat /root/x.txt')).stdout
await again.kill()
out.running = await again.isRunning()
console.log(JSON.stringify(out))
