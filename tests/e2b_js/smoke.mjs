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
await sbx.pause()
const again = await Sandbox.connect(sbx.sandboxId)
out.afterConnect = (await again.commands.run('cat /root/x.txt')).stdout
await again.kill()
out.running = await again.isRunning()
console.log(JSON.stringify(out))
